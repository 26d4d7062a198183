"""Exact statistics against a float64 reference: sort-based quartiles, float64 moments and the
backbone's own quantizer applied to the whole tensor at once, for every dtype and path, one
tensor at a time or a batch."""

from __future__ import annotations

import math

import pytest
import torch

from llmq.config import QuantArgs
from llmq.fallback.stats import batch_stats, tensor_stats
from tests.fallback.conftest import (
    FP8_TENSOR,
    INT4_G64_ASYM,
    INT8_CHANNEL,
    INT8_TENSOR,
    INT8_TENSOR_ASYM,
    assert_matches,
    heavy_tailed,
    reference,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "args", [None, INT8_TENSOR, INT8_TENSOR_ASYM, INT8_CHANNEL, INT4_G64_ASYM, FP8_TENSOR]
)
def test_statistics_match_float64_reference(dtype: torch.dtype, args: QuantArgs | None) -> None:
    weight = heavy_tailed(96, 320, dtype)
    stats = tensor_stats(weight, args)
    # float32 sums and float32 dequantized codes bound the agreement at ~1e-6
    assert_matches(stats, reference(weight, args), rel=1e-5)
    assert stats.tail_share > 0 and stats.nan == stats.inf == 0


def test_float32_holding_bfloat16_values_matches_reference() -> None:
    weight = heavy_tailed(64, 256, torch.bfloat16).to(torch.float32)
    for args in (INT8_TENSOR, INT4_G64_ASYM):
        assert_matches(tensor_stats(weight, args), reference(weight, args), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_inputs(dtype: torch.dtype) -> None:
    weight = heavy_tailed(32, 128, torch.float32).mul(100).clamp(-400, 400).to(dtype)
    assert_matches(tensor_stats(weight, INT8_CHANNEL), reference(weight, INT8_CHANNEL), rel=1e-5)


def test_over_16m_elements_exact_where_torch_quantile_refuses() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(17 * 1024 * 1024 + 3, generator=g).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        torch.quantile(weight.float(), 0.25)
    stats = tensor_stats(weight, INT8_TENSOR)
    ordered = weight.float().sort().values  # float32 is exact for bfloat16 values
    n = weight.numel()
    for q, got in ((0.25, stats.q1), (0.75, stats.q3)):
        position = q * (n - 1)
        low, high = ordered[math.floor(position)].item(), ordered[math.ceil(position)].item()
        assert got == pytest.approx(low + (high - low) * (position - math.floor(position)), abs=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_inf_are_counted_and_excluded(dtype: torch.dtype) -> None:
    weight = heavy_tailed(16, 64, torch.float32)
    weight[0, 0], weight[1, 1], weight[2, 2] = math.nan, math.inf, -math.inf
    clean = weight.reshape(-1)[weight.reshape(-1).isfinite()]
    stats = tensor_stats(weight.to(dtype), INT8_TENSOR)
    assert (stats.nan, stats.inf, stats.numel) == (1, 2, weight.numel())
    assert stats.nrmse is None  # a tensor with NaN/Inf cannot be quantized
    expected = reference(clean.to(dtype).reshape(1, -1), None)
    assert_matches(stats, expected, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tails_counted_exactly_when_values_sit_at_the_threshold(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(60000, generator=g) * 0.01
    weight[::20] = torch.rand(3000, generator=g) * 4 - 2  # 6 sigma (~1.55) falls inside these
    weight = weight.reshape(300, 200).to(dtype)
    stats, expected = tensor_stats(weight, None), reference(weight, None)
    assert stats.tail_share == expected["tail_share"] > 0
    assert (stats.q1, stats.q3) == (expected["q1"], expected["q3"])


@pytest.mark.parametrize("args", [INT8_TENSOR, INT8_TENSOR_ASYM, INT4_G64_ASYM, None])
def test_batch_gives_each_tensor_its_own_statistics(args: QuantArgs | None) -> None:
    """A batch mixes what the scan meets in one file: float32 weights (whose grids are chosen
    together), a float32 tensor holding bfloat16 values, a tensor with NaN and Inf, bf16, and
    input weights for one of them; each result must be the tensor's own, alone."""
    with_nan = heavy_tailed(32, 64, torch.float32, seed=3)
    with_nan[0, 0], with_nan[1, 1] = math.nan, math.inf
    weights = [
        heavy_tailed(64, 256, torch.float32, seed=1),
        heavy_tailed(48, 128, torch.float32, seed=2) * 40,  # another scale: another grid
        heavy_tailed(16, 64, torch.bfloat16, seed=4).to(torch.float32),
        with_nan,
        heavy_tailed(32, 64, torch.bfloat16, seed=5),
        torch.linspace(-0.3, 0.7, 576),
    ]
    input_weights = [None, torch.rand(128, generator=torch.Generator().manual_seed(6)), *[None] * 4]
    batch = batch_stats(weights, args, input_weights=input_weights)
    alone = [
        tensor_stats(w, args, input_weights=iw)
        for w, iw in zip(weights, input_weights, strict=True)
    ]
    assert batch == alone
    for weight, stats in zip(weights, batch, strict=True):
        if weight.isfinite().all() and weight.ndim > 1:  # a 1-D tensor has no rows to group
            assert_matches(stats, reference(weight, args), rel=1e-5)
    assert (batch[3].nan, batch[3].inf, batch[3].nrmse) == (1, 1, None)
    assert args is None or batch[1].weighted_nrmse is not None
