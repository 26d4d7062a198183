"""Exact statistics against a float64 reference: sort-based quartiles, float64 moments and the
backbone's own quantizer applied to the whole tensor at once."""

from __future__ import annotations

import math

import pytest
import torch

import llmq.fallback.stats as stats_module
from llmq.config import QuantArgs
from llmq.fallback.stats import TensorStats, batch_stats, spread_ratio, tensor_stats
from llmq.quant.primitives import quantize_weight

INT8_TENSOR = QuantArgs(num_bits=8, strategy="tensor")
INT8_TENSOR_ASYM = QuantArgs(num_bits=8, strategy="tensor", symmetric=False)
INT8_CHANNEL = QuantArgs(num_bits=8, strategy="channel")
INT4_G64_ASYM = QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=False)
FP8_TENSOR = QuantArgs(num_bits=8, type="float", strategy="tensor")


def reference(weight: torch.Tensor, args: QuantArgs | None) -> dict[str, float]:
    """float64 everything; quartiles by torch.quantile on the sorted values."""
    x = weight.to(torch.float64).reshape(-1)
    x = x[x.isfinite()]
    q1, q3 = torch.quantile(x, torch.tensor([0.25, 0.75], dtype=torch.float64)).tolist()
    mean, std = float(x.mean()), float(x.std(unbiased=False))
    out = {
        "q1": q1, "q3": q3, "mean": mean, "std": std, "min": float(x.min()), "max": float(x.max()),
        "tail_share": float(((x - mean).abs() > 6 * std).double().mean()),
    }  # fmt: skip
    if args is not None:
        rows = weight.reshape(-1, weight.shape[-1])
        scale_dtype = weight.dtype if weight.element_size() >= 2 else torch.float32
        rows = rows.to(scale_dtype)  # FP8 values are exact in float32
        restored = quantize_weight(rows, args, scale_dtype=scale_dtype).dequantize(torch.float64)
        error = (rows.to(torch.float64) - restored).square().sum()
        out["nrmse"] = math.sqrt(error / x.square().sum())
        out["range_nrmse"] = math.sqrt(error / x.numel()) / (out["max"] - out["min"])
    return out


def assert_matches(stats: TensorStats, expected: dict[str, float], *, rel: float) -> None:
    for key in ("q1", "q3", "min", "max"):  # order statistics are exact
        assert getattr(stats, key) == pytest.approx(expected[key], rel=1e-12, abs=0), key
    for key, value in expected.items():
        assert getattr(stats, key) == pytest.approx(value, rel=rel, abs=1e-12), key


def heavy_tailed(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[3, 5], w[7, 1] = 1.5, -0.9  # outliers far beyond 6 sigma
    return w.to(dtype)


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


@pytest.mark.parametrize("args", [INT8_CHANNEL, INT4_G64_ASYM])
def test_row_blocks_do_not_change_errors(monkeypatch: pytest.MonkeyPatch, args: QuantArgs) -> None:
    weight = heavy_tailed(50, 192, torch.float32, seed=3)
    whole = tensor_stats(weight, args)
    monkeypatch.setattr(stats_module, "CHUNK_ELEMENTS", 1000)  # 10 blocks of 5 rows
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


def test_all_zero_and_constant_tensors() -> None:
    zeros = tensor_stats(torch.zeros(8, 64, dtype=torch.bfloat16), INT8_TENSOR)
    assert (zeros.nrmse, zeros.std, zeros.q1, zeros.q3) == (0.0, 0.0, 0.0, 0.0)
    assert zeros.spread_ratio == 0.0
    ones = tensor_stats(torch.ones(4, 32), INT8_CHANNEL)
    assert ones.nrmse == 0.0 and ones.absmax == 1.0


def test_spread_ratio_flags_an_outlier() -> None:
    gaussian = tensor_stats(heavy_tailed(256, 256, torch.bfloat16)[8:], None)
    outlier = tensor_stats(heavy_tailed(256, 256, torch.bfloat16), None)
    assert gaussian.spread_ratio < 12 and outlier.spread_ratio > 60
    assert spread_ratio(-1.0, 1.0, 0.0, 0.0) == math.inf


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
