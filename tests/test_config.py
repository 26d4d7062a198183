"""QuantArgs refuses what no llmq code path can quantize, with the reason."""

from __future__ import annotations

import pytest

from llmq.config import QuantArgs


def _float(num_bits: int, strategy: str, group_size: int | None, **extra: object) -> dict:
    return {"num_bits": num_bits, "type": "float", "strategy": strategy, "group_size": group_size, **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"strategy": "group", "group_size": 48}, "not a power of two"),
        ({"strategy": "channel", "group_size": 64}, "only used with group strategies"),
        ({"strategy": "block"}, "block_structure goes with strategy 'block'"),
        ({"strategy": "block", "block_structure": (16, 32), "symmetric": False}, "no zero point"),
        ({"strategy": "channel", "type": "float", "num_bits": 4}, "float codes in groups"),
        ({"strategy": "group", "group_size": 32, "type": "float", "num_bits": 4}, "scale_dtype"),
        (_float(8, "group", 16, scale_dtype="uint8"), "groups of 32, not 16"),
        (_float(8, "tensor_group", 16, scale_dtype="float8_e4m3fn"), "codes are FP4"),
        (_float(4, "group", 16, scale_dtype="float8_e4m3fn"), "tensor_group goes with"),
        (_float(4, "group", 32, scale_dtype="uint8", dynamic="local"), 'dynamic "local" needs'),
        (_float(8, "channel", None, symmetric=False), "no zero point"),
    ],
)
def test_inconsistent_arguments_are_refused(fields: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        QuantArgs(**{"num_bits": 8, **fields})
