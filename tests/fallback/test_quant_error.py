"""The scan's quantization errors against `quantize`'s own codes on the whole tensor: per tensor,
per channel and per group, in row blocks, and weighted by input channels."""

from __future__ import annotations

import math

import pytest
import torch

import llmq.fallback.quant_error as quant_error_module
from llmq.config import QuantArgs
from llmq.fallback.stats import tensor_stats
from llmq.quant.primitives import quantize_weight
from tests.fallback.conftest import (
    INT4_G64_ASYM,
    INT8_CHANNEL,
    INT8_TENSOR,
    INT8_TENSOR_ASYM,
    heavy_tailed,
    reference,
)


@pytest.mark.parametrize("args", [INT8_CHANNEL, INT4_G64_ASYM])
def test_row_blocks_do_not_change_errors(monkeypatch: pytest.MonkeyPatch, args: QuantArgs) -> None:
    weight = heavy_tailed(50, 192, torch.float32, seed=3)
    whole = tensor_stats(weight, args)
    monkeypatch.setattr(quant_error_module, "CHUNK_ELEMENTS", 1000)  # 10 blocks of 5 rows
    blocked = tensor_stats(weight, args)
    assert blocked.nrmse == pytest.approx(whole.nrmse, rel=1e-12)  # float64 sums, another order


@pytest.mark.parametrize("args", [INT8_TENSOR, INT8_TENSOR_ASYM])
def test_float32_per_tensor_error_matches_quantize(args: QuantArgs) -> None:
    """The per-tensor integer check divides in float32 where `quantize` divides in float64: over
    a million values, the squared error still matches quantize's own codes'."""
    weight = heavy_tailed(1000, 1000, torch.float32, seed=11)
    stats = tensor_stats(weight, args)
    flat = weight.reshape(1, -1)
    restored = quantize_weight(flat, args, scale_dtype=torch.float32).dequantize()
    error = float((flat - restored).double().square().sum())
    squares = float(flat.double().square().sum())
    assert stats.nrmse == pytest.approx(math.sqrt(error / squares), rel=1e-6)


def test_one_dimensional_tensor_has_no_row_error() -> None:
    norm = torch.linspace(0.5, 1.5, 576)
    assert tensor_stats(norm, INT8_CHANNEL).nrmse is None
    assert tensor_stats(norm, INT8_TENSOR).nrmse is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("args", [INT8_TENSOR, INT4_G64_ASYM])
def test_weighted_nrmse_matches_float64_reference(dtype: torch.dtype, args: QuantArgs) -> None:
    weight = heavy_tailed(64, 256, dtype)
    g = torch.Generator().manual_seed(5)
    input_weights = torch.rand(256, generator=g) ** 4  # a few inputs matter, most barely
    stats = tensor_stats(weight, args, input_weights=input_weights)
    restored = quantize_weight(weight, args).dequantize(torch.float64)
    w64, iw = weight.to(torch.float64), input_weights.to(torch.float64)
    expected = ((w64 - restored).square().sum(0) @ iw / (w64.square().sum(0) @ iw)).sqrt()
    assert stats.weighted_nrmse == pytest.approx(float(expected), rel=1e-5)
    output = (w64 - restored).square().sum(0) @ iw  # sum_j ||dW_:j||^2 w_j
    assert stats.output_error == pytest.approx(float(output), rel=1e-5)
    assert stats.nrmse == pytest.approx(reference(weight, args)["nrmse"], rel=1e-5)
    uniform = tensor_stats(weight, args, input_weights=torch.ones(256))
    # the same quantity two ways: float64 column sums, and (for nrmse of float32 weights)
    # float32 cascaded sums of ||W||^2, good to ~1e-7
    assert uniform.weighted_nrmse == pytest.approx(uniform.nrmse, rel=1e-6)
    assert tensor_stats(weight, args, input_weights=torch.ones(7)).weighted_nrmse is None
