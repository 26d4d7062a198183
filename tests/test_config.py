"""QuantArgs refuses what no llmq code path can quantize, with the reason."""

from __future__ import annotations

import pytest

from llmq.config import QuantArgs


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"strategy": "group", "group_size": 48}, "not a power of two"),
        ({"strategy": "channel", "group_size": 64}, "only used with strategy 'group'"),
        ({"strategy": "block"}, "block_structure goes with strategy 'block'"),
        ({"strategy": "block", "block_structure": (16, 32), "symmetric": False}, "no zero point"),
        ({"strategy": "channel", "type": "float", "num_bits": 4}, "FP8 E4M3"),
    ],
)
def test_inconsistent_arguments_are_refused(fields: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        QuantArgs(**{"num_bits": 8, **fields})
