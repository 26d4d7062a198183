"""Floating-point code grids and the scales of the microscaled formats.

Codes:  FP8 E4M3 (largest 448) and FP4 E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives).
    Both are held as float8_e4m3fn tensors: every E2M1 value is an E4M3 value, so one code dtype
    serves both and packing FP4 two to a byte happens only on disk (`llmq.pack.format`).
    Rounding is to nearest, ties to the even mantissa, after saturating at the largest value.
NVFP4 (strategy "tensor_group"):  global = 448 · 6 / absmax(tensor) in float32; each group of 16
    stores s = E4M3(absmax(group) / 6 · global); the values are code · (s / global), the
    division in float32 as compressed-tensors and vLLM compute it.
MX (scale_dtype "uint8", groups of 32):  each group's scale is a power of two stored as its E8M0
    exponent; 2^(floor(log2 absmax) - emax), one binade up when the extreme's mantissa is at
    least 1.75 (emax = floor(log2 of the largest code): 2 for E2M1, 8 for E4M3), the OCP rule
    as compressed-tensors and vLLM's reference compute it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llmq.config import FLOAT_CODE_MAX, QuantArgs

FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = torch.float8_e8m0fnu  # a power of two: its bits are the biased exponent (uint8)
E8M0_BIAS, E8M0_LIMIT = 127, 127  # exponents from -127 to 127 (255 is NaN)
# The scale dtypes of the microscaled formats, by compressed-tensors' `scale_dtype` name
SCALE_DTYPES = {"float8_e4m3fn": FP8_DTYPE, "uint8": E8M0_DTYPE}
_MX_ROUND_UP = 1.75  # a group extreme's mantissa from which its scale takes the next binade


def float_code_max(args: QuantArgs) -> float:
    return FLOAT_CODE_MAX[args.num_bits]


def scale_storage(args: QuantArgs, default: torch.dtype) -> torch.dtype:
    """The dtype `args`'s scales are stored in: the format's own, else `default`."""
    return SCALE_DTYPES[args.scale_dtype] if args.scale_dtype is not None else default


def round_e2m1_(x: Tensor) -> Tensor:
    """Values within ±6 -> the nearest E2M1 value, ties to the even mantissa, in place. The
    grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6, and an even multiple of the spacing
    is an even mantissa, so round-half-even of x / spacing is the rule. Keeps the sign of zero."""
    magnitude = x.abs()
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0)).to(x.dtype)
    magnitude.div_(spacing).round_().mul_(spacing)
    return x.copy_(magnitude.copysign_(x))


def to_float_grid_(scaled: Tensor, args: QuantArgs) -> Tensor:
    """Values divided by their scale -> saturated at the largest code; E2M1 values rounded here,
    E4M3 ones by the cast to float8_e4m3fn that follows."""
    limit = float_code_max(args)
    scaled.clamp_(-limit, limit)
    return round_e2m1_(scaled) if args.num_bits == 4 else scaled


def mx_scale(absmax: Tensor, args: QuantArgs) -> Tensor:
    """The power-of-two scale (E8M0) of groups whose extreme is `absmax` (float64)."""
    mantissa, exponent = torch.frexp(absmax.to(torch.float64))  # absmax = mantissa · 2^exponent
    top = math.floor(math.log2(float_code_max(args)))  # E2M1: 2, E4M3: 8
    binade = exponent - 1 + (2 * mantissa >= _MX_ROUND_UP).to(exponent.dtype)
    power = torch.where(absmax > 0, binade - top, -E8M0_LIMIT).clamp(-E8M0_LIMIT, E8M0_LIMIT)
    return torch.ldexp(torch.ones_like(absmax, dtype=torch.float32), power).to(E8M0_DTYPE)


def nvfp4_global_scale(absmax: Tensor | float) -> Tensor:
    """NVFP4's per-tensor float32 scale [1] for values of range ±absmax: the largest power of
    two that keeps the largest group scale within E4M3 (448 · 6 / absmax, rounded down to a
    power of two). A power of two makes every value code · scale / global exact in bfloat16
    (at most 6 significant bits), so the readers that dequantize to bfloat16 (compressed-
    tensors, vLLM without FP4 tensor cores) agree bit for bit with those that do not; it costs at
    most one of E4M3's 17 binades at the top. 1.0 for an all-zero tensor (no scaling)."""
    absmax = torch.as_tensor(absmax, dtype=torch.float64).reshape(1)
    top = FLOAT_CODE_MAX[8] * FLOAT_CODE_MAX[4]
    ratio = torch.where(absmax > 0, top / absmax, 1.0)
    return torch.exp2(torch.floor(torch.log2(ratio)).clamp(max=E8M0_LIMIT)).to(torch.float32)


def fp8_group_scale(absmax: Tensor, global_scale: Tensor) -> Tensor:
    """NVFP4's stored group scales: E4M3(absmax / 6 · global), saturated; a group of zeros
    gets E4M3's eps (its codes are zero whatever the scale)."""
    scale = (absmax / FLOAT_CODE_MAX[4] * global_scale.to(absmax)).clamp_(max=FLOAT_CODE_MAX[8])
    scale = scale.to(FP8_DTYPE)
    return torch.where(scale.float() == 0, torch.finfo(FP8_DTYPE).eps, scale.float()).to(FP8_DTYPE)


def effective_scale(scale: Tensor, global_scale: Tensor | None) -> Tensor:
    """What a code is multiplied by: the stored scale, over the global scale where there is one
    (in float32, as the formats' readers divide)."""
    if global_scale is None:
        return scale.to(torch.float32)
    return scale.to(torch.float32) / global_scale.to(device=scale.device, dtype=torch.float32)
