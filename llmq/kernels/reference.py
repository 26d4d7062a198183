"""The math every kernel computes, in plain torch: what the Triton kernels are tested against and
what quantized linears run on a machine without a GPU.

Kept apart from the kernel modules so that it imports where Triton does not install (macOS,
Windows): the CPU path of `llmq.load_quantized` needs only torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmq.pack.layout import E2M1_MAGNITUDES, FP8_CODES, INT4_PER_WORD, W4A16Weight, W8A8Weight

INT8_MAX = 127.0
INT8_MIN = -128.0  # reached only by static scales, whose inputs may exceed the calibrated range
FP8_MAX = float(torch.finfo(FP8_CODES).max)  # 448
# A row of zeros gets this scale (and zero codes), never a division by zero: llmq's eval does
# the same (`llmq.quant.primitives.fake_quantize`).
SCALE_EPS = float(torch.finfo(torch.float32).eps)


def unpack_int4(packed: Tensor, in_features: int) -> Tensor:
    """Signed int4 codes int8 [out, in] from words int32 [out, ceil(in / 8)]."""
    shifts = torch.arange(INT4_PER_WORD, device=packed.device, dtype=torch.int32) * 4
    fields = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (fields.reshape(packed.shape[0], -1)[:, :in_features] - 8).to(torch.int8)


def unpack_e2m1(packed: Tensor, in_features: int) -> Tensor:
    """FP4 E2M1 values float32 [out, in] from words int32 [out, in / 8] (`W4A16Weight.fp4`)."""
    shifts = torch.arange(INT4_PER_WORD, device=packed.device, dtype=torch.int32) * 4
    nibbles = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)
    magnitude = torch.tensor(E2M1_MAGNITUDES, device=packed.device)[(nibbles & 0x7).long()]
    return torch.where(nibbles >= 8, -magnitude, magnitude)[:, :in_features]


def dequantize_int4(weight: W4A16Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The float weight [out, in] a W4A16 kernel multiplies by, computed in `dtype`."""
    unpack = unpack_e2m1 if weight.fp4 else unpack_int4
    codes = unpack(weight.packed, weight.in_features).to(dtype)
    n, k, size = weight.out_features, weight.in_features, weight.group_size
    if weight.g_idx is None and k % size == 0:  # whole groups: broadcast, no gather
        grouped = codes.view(n, k // size, size)
        if weight.zero is not None:
            grouped = grouped - weight.zero.to(dtype).view(n, -1, 1)
        return (grouped * weight.scale.to(dtype).view(n, -1, 1)).view(n, k)
    groups = _input_groups(weight)
    if weight.zero is not None:
        codes = codes - weight.zero.to(dtype)[:, groups]
    return codes * weight.scale.to(dtype)[:, groups]


def _input_groups(weight: W4A16Weight) -> Tensor:
    if weight.g_idx is not None:
        return weight.g_idx.long()
    columns = torch.arange(weight.in_features, device=weight.packed.device)
    return columns // weight.group_size


def w4a16_linear(x: Tensor, weight: W4A16Weight) -> Tensor:
    """y = x @ dequantize(W)^T for x [M, K] in float16/bfloat16/float32, accumulated in float32."""
    return (x.float() @ dequantize_int4(weight).T).to(x.dtype)


def quantize_rows(
    x: Tensor, fp8: bool, static_scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token quantization of x [M, K]: codes (int8, or float8_e4m3fn) and float32 scales [M].
    Dynamic: scale = absmax / 127 (or / 448) per row. Static: every row takes `static_scale` [1],
    the calibrated input_scale. Integer codes round half to even and saturate at -128..127."""
    rows = x.float()
    if static_scale is None:
        scale = rows.abs().amax(dim=1) / (FP8_MAX if fp8 else INT8_MAX)
        scale = torch.where(scale == 0, torch.full_like(scale, SCALE_EPS), scale)
    else:
        scale = static_scale.float().reshape(1).expand(rows.shape[0]).contiguous()
    scaled = rows / scale[:, None]
    if fp8:
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_CODES), scale
    return scaled.round().clamp(INT8_MIN, INT8_MAX).to(torch.int8), scale


def w8a8_linear(x: Tensor, weight: W8A8Weight) -> Tensor:
    """y = (q(x) @ W_codes^T) * scale_x[m] * scale_w[n] with q the per-token quantization above:
    what the W8A8-INT8 and FP8 kernels compute, including their activation quantization (dynamic,
    or static with the weight's input_scale)."""
    codes, x_scale = quantize_rows(x, weight.is_fp8, weight.input_scale)
    product = codes.float() @ weight.codes.float().T
    return (product * x_scale[:, None] * weight.scale[None, :].float()).to(x.dtype)
