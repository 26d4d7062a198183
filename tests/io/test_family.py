from __future__ import annotations

import pytest

from llmq.io.family import FAMILY_LAYOUT


@pytest.mark.parametrize("family", sorted(FAMILY_LAYOUT))
def test_the_norm_before_each_block_is_the_one_feeding_its_first_group(family: str) -> None:
    layout = FAMILY_LAYOUT[family]
    assert layout.norm_before(layout.attention) == "input_layernorm"
    assert layout.norm_before(layout.mlp) == "post_attention_layernorm"
