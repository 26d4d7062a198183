"""`stored_bytes` is exactly what the writer stores: the bytes of the tensors `compress` makes
for a linear, for every pack-quantized layout and dtype, and the dense weight as stored."""

from __future__ import annotations

import pytest
import torch

from llmq.config import QuantArgs
from llmq.pack.format import PackFormat, compress
from llmq.pack.sizes import stored_bytes
from llmq.quant.rtn import rtn_quantize_weight

ARGS = [
    QuantArgs(num_bits=4, strategy="group", group_size=128),
    QuantArgs(num_bits=4, strategy="group", group_size=16),
    QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False),
    QuantArgs(num_bits=8, strategy="channel"),
    QuantArgs(num_bits=8, strategy="group", group_size=64),
    QuantArgs(num_bits=4, strategy="channel", symmetric=False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("args", ARGS, ids=lambda a: a.label + ("" if a.symmetric else " asym"))
@pytest.mark.parametrize("shape", [(96, 256), (13, 384), (7, 128)])
def test_stored_bytes_equal_the_written_tensors(args: QuantArgs, dtype: torch.dtype, shape: tuple) -> None:  # fmt: skip
    weight = torch.randn(shape).to(dtype)
    written = compress(rtn_quantize_weight(weight, args, scale_dtype=dtype), PackFormat.PACK_QUANTIZED)  # fmt: skip
    assert stored_bytes(args, *shape, dtype) == sum(t.numel() * t.element_size() for t in written.values())  # fmt: skip


def test_a_dense_linear_counts_its_weight_as_stored() -> None:
    assert stored_bytes(None, 10, 30, torch.bfloat16) == 600


def test_other_formats_are_not_counted_silently() -> None:
    with pytest.raises(ValueError, match="not a pack-quantized"):
        stored_bytes(QuantArgs(num_bits=8, type="float", strategy="channel"), 4, 4, torch.float32)
