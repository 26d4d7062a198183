"""FP4 E2M1, FP8 E4M3 and E8M0 codes and the NVFP4 / MX scales against float64 references and
compressed-tensors' own helpers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

from llmq.config import QuantArgs, get_scheme
from llmq.quant.floats import (
    E8M0_DTYPE,
    fp8_group_scale,
    mx_scale,
    nvfp4_global_scale,
    round_e2m1_,
    to_float_grid_,
)
from llmq.quant.primitives import fake_quantize, quantize_weight
from tests.quant.conftest import E2M1, nearest_e2m1

NVFP4, MXFP4, MXFP8 = (get_scheme(name).weights for name in ("nvfp4a16", "mxfp4a16", "mxfp8"))


def test_every_e2m1_value_and_midpoint_rounds_as_the_reference() -> None:
    values = sorted({s * v for s in (1, -1) for v in E2M1})
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(values)]
    nearby = [m + d for m in midpoints for d in (-1e-9, 1e-9)]
    probes = [*values, *midpoints, *nearby, 6.5, 7.0, 100.0, -7.0, -1e30, 1e-30]
    x = torch.tensor(probes, dtype=torch.float64)
    got = to_float_grid_(x.clone(), MXFP4)  # saturated at ±6, then rounded
    assert got.tolist() == [nearest_e2m1(p) for p in probes]
    assert got[: len(values)].tolist() == values  # representable values stay as they are
    assert round_e2m1_(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0,
    ]  # fmt: skip


def test_e2m1_keeps_the_sign_of_zero() -> None:
    zeros = round_e2m1_(torch.tensor([-0.0, -0.1, 0.0, 0.2]))
    assert zeros.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert torch.signbit(zeros).tolist() == [True, True, False, False]


def test_e2m1_grid_is_random_data_nearest() -> None:
    x = torch.randn(20_000, dtype=torch.float64) * 3
    got = to_float_grid_(x.clone(), MXFP4)
    assert got.tolist() == [nearest_e2m1(v) for v in x.tolist()]


def test_e4m3_codes_are_the_nearest_fp8_value_with_saturation() -> None:
    """Every finite E4M3 value survives; values beyond 448 saturate; between two values, the
    nearest (ties to the even mantissa, the even bit pattern) as a float64 reference finds."""
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = finite.double()[torch.isfinite(finite.double())].unique()
    grid = sorted(finite.tolist())
    probes = torch.tensor([*grid, *((a + b) / 2 for a, b in itertools.pairwise(grid)), 500.0, -1e6])
    codes = to_float_grid_(probes.clone(), MXFP8).to(torch.float8_e4m3fn).double()

    def reference(x: float) -> float:
        x = max(min(x, 448.0), -448.0)
        return min(grid, key=lambda v: (abs(x - v), _odd_mantissa(v)))

    assert codes.tolist() == [reference(p) for p in probes.tolist()]


def _odd_mantissa(value: float) -> bool:
    code = torch.tensor([value], dtype=torch.float64).to(torch.float8_e4m3fn).view(torch.uint8)
    return bool(int(code) & 1)


@pytest.mark.parametrize("args", [MXFP4, MXFP8], ids=lambda a: a.label)
def test_mx_scales_match_compressed_tensors_and_the_float64_rule(args: QuantArgs) -> None:
    absmax = torch.cat([torch.rand(4000) * 10.0 ** torch.randint(-6, 6, (4000,)), torch.tensor(
        [1.0, 1.5, 1.74, 1.75, 1.99, 2.0, 6.0, 7.0, 448.0, 500.0]
    )])  # fmt: skip
    scale = mx_scale(absmax, args)
    assert scale.dtype == E8M0_DTYPE
    exponent = scale.view(torch.uint8).long() - 127
    theirs = generate_mx_scales(absmax.float(), num_bits=args.num_bits).long() - 127
    assert torch.equal(exponent, theirs)
    top = 2 if args.num_bits == 4 else 8  # floor(log2) of the largest code
    for a, e in zip(absmax.tolist(), exponent.tolist(), strict=True):
        binade = math.floor(math.log2(a))
        assert e == binade - top + (a / 2.0**binade >= 1.75)
    # the extreme never lands beyond the grid by more than rounding to its top value allows
    assert torch.all(absmax / scale.float() < (7.0 if args.num_bits == 4 else 448.0))


def test_mx_scale_of_zero_and_extremes_stay_in_e8m0() -> None:
    scale = mx_scale(torch.tensor([0.0, 1e-45, 3e38], dtype=torch.float64), MXFP4)
    assert scale.view(torch.uint8).tolist()[0] == 0  # 2^-127: a zero group's codes are zeros
    assert torch.isfinite(scale.float()).all()


def test_nvfp4_global_scale_is_a_power_of_two_within_e4m3() -> None:
    for absmax in (1e-3, 0.37, 1.0, 6.0, 2688.0, 12345.6):
        scale = float(nvfp4_global_scale(absmax))
        assert scale == 2.0 ** round(math.log2(scale))
        assert absmax / 6 * scale <= 448.0 < absmax / 6 * scale * 2  # the largest group fits
    assert float(nvfp4_global_scale(0.0)) == 1.0


def test_nvfp4_values_are_exact_in_bfloat16() -> None:
    """A power-of-two global scale: code · scale / global has at most 6 significant bits, so
    readers that dequantize to bfloat16 get exactly llmq's values."""
    torch.manual_seed(0)
    w = torch.randn(32, 256) * torch.logspace(-3, 1, 32).unsqueeze(1)
    values = quantize_weight(w, NVFP4).dequantize(torch.float32)
    assert torch.equal(values, values.to(torch.bfloat16).float())


def test_nvfp4_group_scales_saturate_and_never_vanish() -> None:
    scale = fp8_group_scale(
        torch.tensor([0.0, 1e-12, 1.0, 1e9], dtype=torch.float64), torch.ones(1)
    )
    assert scale.dtype == torch.float8_e4m3fn
    assert scale.float().tolist() == [0.125, 0.125, 0.171875, 448.0]  # eps, eps, E4M3(1/6), max


@pytest.mark.parametrize("args", [NVFP4, MXFP4, MXFP8], ids=lambda a: a.label)
def test_weights_within_the_format_bound(args: QuantArgs) -> None:
    """Each value within half a grid step of the saturated range: |Δ| <= scale · (top step / 2)
    relative to the group's effective scale (E2M1: steps up to 2; E4M3: 1/16 relative)."""
    torch.manual_seed(1)
    w = torch.randn(64, 128) * torch.rand(64, 1)
    q = quantize_weight(w, args)
    delta = (q.dequantize() - w).abs().reshape(64, -1, args.group_size)
    scale = q.scale.float()
    if q.global_scale is not None:
        scale = scale / q.global_scale
    if args.num_bits == 4:
        bound = scale.unsqueeze(-1) * 1.0  # half of E2M1's widest step (4 -> 6)
    else:
        bound = w.abs().reshape(64, -1, args.group_size) / 16 + scale.unsqueeze(-1) * 2.0**-9
    assert torch.all(delta <= bound * (1 + 1e-6))


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "nvfp4"])
def test_fake_quantized_activations_use_the_formats_groups(name: str) -> None:
    """Inputs quantized per group of the format at run time: the same values as quantizing
    each token's groups as weights (NVFP4: under the calibrated global scale)."""
    args = get_scheme(name).input_activations
    torch.manual_seed(2)
    x = torch.randn(3, 5, 64) * 4
    global_scale = nvfp4_global_scale(float(x.abs().max())) if name == "nvfp4" else None
    got = fake_quantize(x, args, global_scale)
    rows = x.reshape(-1, 64)
    q = quantize_weight(rows, args.model_copy(update={"dynamic": False}))
    assert torch.equal(got.reshape(-1, 64), q.dequantize())
    assert args.dynamic == ("local" if name == "nvfp4" else True)


def test_every_e8m0_byte_decodes_and_encodes_back() -> None:
    """Each E8M0 byte b (0..254) is the scale 2^(b - 127) in float64 (bit exact in float32),
    and a group whose extreme is exactly that scale times 4 (E2M1's top binade) gets byte b."""
    codes = torch.arange(255, dtype=torch.uint8)
    decoded = codes.view(E8M0_DTYPE).to(torch.float64)
    assert decoded.tolist() == [2.0 ** (b - 127) for b in range(255)]
    extremes = decoded[2:] * 4.0  # mantissa 1: no rounding up to the next binade
    assert torch.equal(mx_scale(extremes, MXFP4).view(torch.uint8), codes[2:])
