"""`stored_bytes` is exactly what the writer stores: the bytes of the tensors `compress` makes
for a linear, for every pack-quantized layout and dtype, the weight-only float formats (FP8
per channel, NVFP4, MXFP4, MXFP8) in the format each is written in, and the dense weight."""

from __future__ import annotations

import pytest
import torch

from llmq.config import QuantArgs, get_scheme
from llmq.pack.format import PackFormat, compress, weight_format
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


FLOATS = [get_scheme(name).weights for name in ("fp8", "nvfp4a16", "mxfp4a16", "mxfp8")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("args", ARGS + FLOATS, ids=lambda a: a.label + ("" if a.symmetric else " asym"))  # fmt: skip
@pytest.mark.parametrize("shape", [(96, 256), (13, 384), (7, 128)])
def test_stored_bytes_equal_the_written_tensors(args: QuantArgs, dtype: torch.dtype, shape: tuple) -> None:  # fmt: skip
    weight = torch.randn(shape).to(dtype)
    fmt = weight_format(args, PackFormat.PACK_QUANTIZED)  # as a budget's candidate is written
    written = compress(rtn_quantize_weight(weight, args, scale_dtype=dtype), fmt)
    assert stored_bytes(args, *shape, dtype) == sum(t.numel() * t.element_size() for t in written.values())  # fmt: skip


def test_each_scheme_writes_its_weights_in_its_own_format() -> None:
    """weight_format keeps every scheme's format: only a budget's candidate of another kind
    changes it."""
    from llmq.config.quant import SCHEMES

    for scheme in SCHEMES.values():
        assert weight_format(scheme.weights, PackFormat(scheme.format)) == PackFormat(scheme.format), scheme.name  # fmt: skip


def test_a_dense_linear_counts_its_weight_as_stored() -> None:
    assert stored_bytes(None, 10, 30, torch.bfloat16) == 600


def test_other_layouts_are_not_counted_silently() -> None:
    with pytest.raises(ValueError, match="strategy block is not counted"):
        stored_bytes(get_scheme("fp8-block").weights, 256, 256, torch.float32)
