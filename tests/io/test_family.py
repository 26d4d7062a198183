from __future__ import annotations

import pytest

from llmq.io.family import FAMILY_LAYOUT


@pytest.mark.parametrize("family", sorted(FAMILY_LAYOUT))
def test_the_norm_before_each_block_is_the_one_feeding_its_first_group(family: str) -> None:
    layout = FAMILY_LAYOUT[family]
    assert layout.norm_before(layout.attention) == "input_layernorm"
    gemma = family.startswith("gemma")  # its MLP reads a norm of its own (four norms a layer)
    mlp_norm = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
    assert layout.norm_before(layout.mlp) == mlp_norm


@pytest.mark.parametrize("family", sorted(FAMILY_LAYOUT))
def test_structured_roles_name_the_layouts_own_modules(family: str) -> None:
    """A family's structured roles slice its linears and norms, nothing the layout lacks: the
    readers of the residual stream are each block's first group, the writers its last."""
    layout = FAMILY_LAYOUT[family]
    roles = layout.structured
    if roles is None:  # `prune --structured` refuses the family
        return
    blocks = dict(layout.blocks)
    attention, mlp = blocks[layout.attention], blocks[layout.mlp]
    assert set(roles.hidden_readers) == {*attention[0], *mlp[0]}
    assert roles.hidden_writers == (attention[-1][0], mlp[-1][0])
    assert roles.query in attention[0] and set(roles.key_value) < set(attention[0])
    assert roles.mlp_input == mlp[0]
    assert roles.norms == (layout.norm_before(layout.attention), layout.norm_before(layout.mlp))
    assert roles.norm_readers == (attention[0][0], mlp[0][0])
