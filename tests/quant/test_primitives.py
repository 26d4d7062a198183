"""Primitives against a float64 reference: identical integer codes, scales to 1e-6."""

from __future__ import annotations

import pytest
import torch

from llmq.config import QuantArgs, get_scheme
from llmq.quant.primitives import (
    FP8_MAX,
    fake_quantize,
    int_range,
    quantize_weight,
    static_scale,
)
from llmq.quant.rtn import CLIP_GRID, clip_ratios, rtn_quantize_weight

ARGS = [
    QuantArgs(num_bits=4, strategy="group", group_size=32),
    QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=False),
    QuantArgs(num_bits=4, strategy="channel"),
    QuantArgs(num_bits=8, strategy="channel"),
    QuantArgs(num_bits=8, strategy="channel", symmetric=False),
    QuantArgs(num_bits=8, strategy="tensor"),
    QuantArgs(num_bits=8, strategy="group", group_size=16),
]


def reference_int(w: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook float64 min/max quantization, written independently of llmq's code. The scale is
    rounded to its storage dtype (the weight's) before codes are computed, as on disk."""
    storage = w.dtype
    w = w.double()
    rows, cols = w.shape
    if args.strategy == "tensor":
        groups = w.reshape(1, 1, -1)
    elif args.strategy == "channel":
        groups = w.reshape(rows, 1, cols)
    else:
        groups = w.reshape(rows, cols // args.group_size, args.group_size)
    qmin, qmax = int_range(args.num_bits)
    lo = groups.amin(-1).clamp(max=0)
    hi = groups.amax(-1).clamp(min=0)
    if args.symmetric:
        scale = torch.maximum(lo / qmin, hi / qmax).to(storage).double()
        codes = torch.round(groups / scale[..., None]).clamp(qmin, qmax)
    else:
        scale = ((hi - lo) / (qmax - qmin)).to(storage).double()
        zero = torch.round(qmin - lo / scale).clamp(qmin, qmax)
        codes = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(qmin, qmax)
    return codes.reshape(rows, cols), scale


@pytest.mark.parametrize("args", ARGS, ids=lambda a: a.label)
def test_integer_codes_match_float64_reference(args: QuantArgs) -> None:
    torch.manual_seed(1)
    w = torch.randn(48, 128) * torch.linspace(0.1, 3, 128)
    q = quantize_weight(w, args)
    ref_codes, ref_scale = reference_int(w, args)
    torch.testing.assert_close(
        q.scale.double().reshape(ref_scale.shape), ref_scale, rtol=1e-6, atol=0
    )
    assert torch.equal(q.codes.double(), ref_codes)
    error = (q.dequantize() - w).abs()
    step = q.scale.float().reshape(-1).max()
    assert float(error.max()) <= float(step) * 0.5 + 1e-6  # never clips: within half a step


@pytest.mark.parametrize("num_bits", [4, 8])
def test_symmetric_extremes_are_exact(num_bits: int) -> None:
    """The value that sets a group's scale is reproduced exactly (no half-step error)."""
    torch.manual_seed(4)
    w = torch.randn(64, 128)
    args = QuantArgs(num_bits=num_bits, strategy="group", group_size=32)
    q = quantize_weight(w, args)
    groups, deq = w.reshape(64, 4, 32), q.dequantize().reshape(64, 4, 32)
    qmin, qmax = int_range(num_bits)
    low, high = groups.amin(-1), groups.amax(-1)
    # the side that sets the scale: the minimum when it needs more of its codes than the maximum
    low_sets = low / qmin >= high / qmax
    setter = torch.where(low_sets, groups.argmin(-1), groups.argmax(-1)).unsqueeze(-1)
    torch.testing.assert_close(deq.gather(-1, setter), groups.gather(-1, setter), rtol=1e-6, atol=0)
    assert (
        q.codes.reshape(64, 4, 32).gather(-1, setter).squeeze(-1)
        == torch.where(low_sets, qmin, qmax)
    ).all()


def test_dynamic_int8_activations_use_the_kernel_scale() -> None:
    x = torch.tensor([[0.0, -2.54, 1.0]])
    args = QuantArgs(num_bits=8, strategy="token", dynamic=True)
    q = quantize_weight(x, args, scale_dtype=torch.float32)
    torch.testing.assert_close(q.scale, torch.tensor([[2.54 / 127]]))
    assert q.codes.tolist() == [[0, -127, 50]]


def test_scale_dtype_rounding_is_consistent() -> None:
    """Codes are computed from the bf16-rounded scale that is stored."""
    torch.manual_seed(2)
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    args = QuantArgs(num_bits=4, strategy="group", group_size=32)
    q = quantize_weight(w, args)
    assert q.scale.dtype == torch.bfloat16
    codes = torch.round(w.double().reshape(8, 2, 32) / q.scale.double()[..., None]).clamp(-8, 7)
    assert q.scale.dtype == torch.bfloat16
    assert torch.equal(q.codes.double(), codes.reshape(8, 64))


def test_fp8_saturates_and_matches_reference() -> None:
    w = torch.tensor([[1000.0, -3.0, 0.001, 0.0], [2.0, -2.0, 1.0, 0.5]])
    args = QuantArgs(num_bits=8, type="float", strategy="channel")
    q = quantize_weight(w, args)
    assert q.codes.dtype == torch.float8_e4m3fn
    assert float(q.codes.float().abs().max()) == FP8_MAX
    scale = w.double().abs().amax(1, keepdim=True) / FP8_MAX
    ref = (w.double() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(q.codes.view(torch.uint8), ref.view(torch.uint8))
    # a value beyond the grid saturates at +-448 instead of becoming NaN
    over = quantize_weight(w, args, clip_ratio=0.5)
    assert torch.isfinite(over.codes.float()).all() and float(over.codes.float().max()) == FP8_MAX


def test_torch_casts_float64_to_fp8_through_float32() -> None:
    """The premise of E4M3 codes computed in float32: a float64 just above an E4M3 midpoint
    rounds to the midpoint in float32, then to the even neighbour (1.0), not up to 1.125."""
    above = torch.tensor([1.0625 * (1 + 2.0**-40)], dtype=torch.float64)
    assert float(above.to(torch.float8_e4m3fn).float()) == 1.0
    assert float(above.to(torch.float32).to(torch.float8_e4m3fn).float()) == 1.0


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fp8_codes_equal_the_float64_path_at_every_midpoint(scale_dtype: torch.dtype) -> None:
    """Weights at every E4M3 midpoint times the scale, one float32 step either side, and in
    between: the codes (computed in float32) equal float64 division, clamp and cast."""
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    grid = finite[finite.isfinite() & (finite > 0)].unique()
    midpoints = (grid[1:] + grid[:-1]) / 2
    rows = []
    for scale in (0.0123, 3.7e-5, 1.0, 211.0):
        stored = torch.tensor(scale, dtype=torch.float64).to(scale_dtype).double()
        near = (midpoints * stored).float()
        values = torch.cat([near, near.nextafter(near + 1), near.nextafter(near - 1), -near])
        extreme = torch.tensor([FP8_MAX * stored], dtype=torch.float32)  # the scale, exactly
        rows.append(torch.cat([extreme, values]))
    w = torch.stack(rows)
    args = QuantArgs(num_bits=8, type="float", strategy="channel")
    q = quantize_weight(w, args, scale_dtype=scale_dtype)
    ref = (w.double() / q.scale.double()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(q.codes.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize(
    "scheme", ["fp8", "fp8-block", "mxfp8", "w8a16", "w4a16", "w4a16-asym", "mxfp4a16", "nvfp4a16"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_weight_quantizes_as_its_float32_copy(scheme: str, dtype: torch.dtype) -> None:
    """Model-free conversion hands weights to the method as they are stored (no float32 copy):
    codes, scales and zero points equal those of the float32 copy the layer pipeline
    quantizes, every value of the 16-bit dtype being a float32 one."""
    args = get_scheme(scheme).weights
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(64, 512, generator=generator) * 0.02).to(dtype)
    weight[0, :8] = torch.tensor([0.0, -0.0, 1e-7, -1e-7, 3.0, -3.0, 1e-30, 65504.0]).to(dtype)
    stored = quantize_weight(weight, args, scale_dtype=torch.bfloat16)
    copied = quantize_weight(weight.float(), args, scale_dtype=torch.bfloat16)
    for name in ("codes", "scale", "zero_point", "global_scale"):
        got, want = getattr(stored, name), getattr(copied, name)
        assert (got is None) == (want is None), name
        assert got is None or torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("kind", ["int", "float"])
def test_fake_quantize_per_token_zero_rows_stay_zero(kind: str) -> None:
    args = QuantArgs(num_bits=8, type=kind, strategy="token", dynamic=True)
    x = torch.randn(2, 5, 64)
    x[0, 2] = 0
    y = fake_quantize(x, args)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0, 2], torch.zeros(64))
    rel = (y - x).norm() / x.norm()
    assert 0 < rel < (0.01 if kind == "int" else 0.05)


@pytest.mark.parametrize(
    "args",
    [
        QuantArgs(num_bits=4, strategy="group", group_size=64),
        QuantArgs(num_bits=8, type="float", strategy="channel"),
    ],
    ids=lambda a: a.label,
)
def test_mse_clip_never_worse_than_minmax(args: QuantArgs) -> None:
    torch.manual_seed(3)
    w = torch.randn(32, 256)
    w[:, 7] *= 20  # outliers make plain min/max wasteful
    plain = (quantize_weight(w, args).dequantize() - w).pow(2).sum()
    clipped = (rtn_quantize_weight(w, args, clip="mse").dequantize() - w).pow(2).sum()
    assert clipped < plain


@pytest.mark.parametrize("symmetric", [True, False])
def test_output_clip_picks_each_groups_best_ratio_in_float64(symmetric: bool) -> None:
    """Every ratio of the grid scored in float64 by the group's share of the output error,
    δ H_gg δᵀ: the search's pick is the minimum (up to float32 rounding of near ties)."""
    torch.manual_seed(4)
    args = QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=symmetric)
    w = torch.randn(24, 128)
    w[:, 5] *= 15
    x = torch.randn(512, 128) * torch.rand(128)
    hessian = 2 * x.T @ x / len(x)
    chosen = clip_ratios(w, args, scale_dtype=torch.float32, hessian=hessian)
    h = hessian.double().reshape(4, 32, 4, 32).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    errors = []
    for ratio in CLIP_GRID:
        delta = quantize_weight(w, args, clip_ratio=ratio).dequantize().double() - w.double()
        delta = delta.reshape(24, 4, 32)
        errors.append(torch.einsum("rgi,gij,rgj->rg", delta, h, delta))
    errors = torch.stack(errors)  # [ratios, rows, groups]
    picked = errors.gather(0, (CLIP_GRID.view(-1, 1, 1) == chosen).double().argmax(0, keepdim=True))
    assert torch.all(picked[0] <= errors.amin(0) * (1 + 1e-5))
    assert (chosen < 1).float().mean() > 0.2  # the outlier column makes clipping pay


def reference_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 reference: saturate at ±448, round to E4M3, scale back."""
    return (values.double() / scale).clamp(-FP8_MAX, FP8_MAX).to(
        torch.float8_e4m3fn
    ).double() * scale


@pytest.mark.parametrize("block", [(128, 128), (128, 64)])
def test_fp8_block_scales_match_float64_reference(block: tuple[int, int]) -> None:
    """One scale per tile; the bottom tiles are partial (200 rows) and take their own range."""
    torch.manual_seed(4)
    w = torch.randn(200, 256) * torch.linspace(0.1, 3, 256)
    args = QuantArgs(num_bits=8, type="float", strategy="block", block_structure=block)
    q = quantize_weight(w, args)
    rows, cols = block
    assert q.scale.shape == (2, 256 // cols)
    codes = torch.empty(200, 256, dtype=torch.float64)
    for i in range(0, 200, rows):
        for j in range(0, 256, cols):
            tile = w[i : i + rows, j : j + cols].double()
            scale = torch.tensor(float(tile.abs().max() / FP8_MAX), dtype=torch.float32).double()
            assert float(q.scale[i // rows, j // cols]) == float(scale)
            codes[i : i + rows, j : j + cols] = reference_fp8(tile, scale) / scale
    assert torch.equal(q.codes.double(), codes)


@pytest.mark.parametrize("kind", ["int", "float"])
def test_static_scales_saturate_and_match_float64_reference(kind: str) -> None:
    args = QuantArgs(num_bits=8, type=kind, strategy="tensor")
    x = torch.randn(3, 7, 64) * 2
    scale = static_scale(1.5, args)  # values beyond ±1.5 saturate
    assert float(scale) == pytest.approx(1.5 / (FP8_MAX if kind == "float" else 127))
    y = fake_quantize(x, args, scale)
    s = scale.double()
    if kind == "float":
        expected = reference_fp8(x, s)
    else:
        expected = torch.round(x.double() / s).clamp(-128, 127) * s
    assert torch.equal(y, expected.float())  # the exact product, rounded once to float32
    top = FP8_MAX if kind == "float" else 127
    assert float(y.max()) == pytest.approx(top * float(s)) and torch.isfinite(y).all()


def test_per_token_group_activations_match_float64_reference() -> None:
    args = QuantArgs(num_bits=8, type="float", strategy="group", group_size=64, dynamic=True)
    x = torch.randn(5, 256)
    x[2, 64:128] = 0  # an all-zero group stays zero
    groups = x.double().reshape(5, 4, 64)
    scale = (groups.abs().amax(-1, keepdim=True) / FP8_MAX).float().double()
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    expected = reference_fp8(groups, scale).reshape(5, 256)
    y = fake_quantize(x, args)
    assert torch.equal(y, expected.float())
    assert torch.equal(y[2, 64:128], torch.zeros(64))


def test_a_zero_static_range_gives_eps_not_nan() -> None:
    args = QuantArgs(num_bits=8, strategy="tensor")
    scale = static_scale(0.0, args)
    assert float(scale) == torch.finfo(torch.float32).eps
    assert torch.equal(fake_quantize(torch.zeros(2, 8), args, scale), torch.zeros(2, 8))


@pytest.mark.parametrize("with_hessian", [False, True])
def test_clip_search_keeps_its_state_on_the_weights_device(with_hessian):
    # The meta device stands in for a GPU: the search failed on a CUDA weight (H200, 2026-11-27)
    # because its best-so-far tensors lived on the CPU.
    args = QuantArgs(num_bits=4, strategy="group", group_size=32)
    x = torch.randn(64, 128)
    hessian = (x.T @ x).to("meta") if with_hessian else None
    chosen = clip_ratios(torch.randn(24, 128).to("meta"), args, hessian=hessian)
    assert chosen.device.type == "meta" and chosen.shape == (24, 4)
