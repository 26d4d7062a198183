"""W8A8: 8-bit weights times 8-bit activations quantized per token at run time, INT8 or FP8 E4M3.

    codes_x[m, :], scale_x[m] = quantize(x[m, :])         (absmax / 127, or absmax / 448)
    y[m, n] = (codes_x[m, :] . codes_w[n, :]) * scale_x[m] * scale_w[n]

Two kernels: one pass quantizes the activations (one program per token row, float32 math),
then an 8-bit GEMM (`tl.dot` int8 x int8 -> int32, or fp8 x fp8 -> float32) applies both scales
in its epilogue and writes float16/bfloat16. Weights are compressed-tensors' int-quantized or
float-quantized tensors as written (`llmq.pack.layout.W8A8Weight`), read as [K, N] tiles of the
[N, K] row-major codes: no repacking.

Rounding: integer codes round half to even with the float32 magic-number trick, exact for
|v| < 2**22, which holds after clamping to 127; it is what the interpreter can run too (its
`rint` is broken) and matches torch.round. FP8 codes are clamped to +-448 and rounded to the E4M3 grid
(half to even, in float32) before the cast, which then is exact: the interpreter's own cast
neither saturates nor carries a rounding into the exponent (127.3 became 64). Hopper accumulates fp8 products in about 22 bits,
so each K tile's dot starts from zero and is added to the float32 accumulator: precision is
restored every BLOCK_K (<= 128) inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llmq.errors import InputError
from llmq.kernels.reference import FP8_MAX, INT8_MAX, INT8_MIN, SCALE_EPS
from llmq.kernels.support import (
    DECODE_MAX_M,
    DECODE_WAVES,
    TileConfig,
    cdiv,
    check_matrix,
    check_same_device,
    launch_stages,
    split_for,
)
from llmq.kernels.tiles import k_tile_range, write_tile
from llmq.kernels.tuning import tuned_config
from llmq.pack.layout import FP8_CODES, W8A8Weight

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Kernels may read module globals only when they are constexpr (compiled Triton refuses others).
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: v + magic - magic rounds half to even
_FP8_MAX = tl.constexpr(FP8_MAX)
_INT8_MAX = tl.constexpr(INT8_MAX)
_INT8_MIN = tl.constexpr(INT8_MIN)
_SCALE_EPS = tl.constexpr(SCALE_EPS)
QUANT_BLOCK = 1024


def choose_config(m: int, n: int, k: int, fp8: bool, device: torch.device) -> TileConfig:
    """The measured table for this GPU when there is one (llmq.kernels.tuning), else the
    built-in rule: decode (M <= 16) with 16-row tiles and K split across SMs; otherwise tiles
    as large as M allows."""
    tuned = tuned_config("w8a8_fp8" if fp8 else "w8a8_int8", m, n, k, device)
    if tuned is not None:
        return tuned
    if m <= DECODE_MAX_M:
        split = split_for(DECODE_WAVES, m, n, k, 16, 64, 128, device)
        return TileConfig("decode", 16, 64, 128, split_k=split, num_stages=4)
    if m <= 64:
        return TileConfig("tiled", 64, 128, 128, num_warps=4, num_stages=4)
    return TileConfig("tiled", 128, 128, 128, num_warps=8, num_stages=3)


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded half to even to the nearest FP8 E4M3 value: 3 mantissa
    bits, so the step is 2**(exponent - 3); subnormals share the smallest normal step 2**-9."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return ((v / step + ROUND_MAGIC) - ROUND_MAGIC) * step


@triton.jit
def _quantize_rows_kernel(
    x_ptr, codes_ptr, scale_ptr, static_ptr, K, stride_xm, stride_cm,
    FP8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """codes[m, :] and scale[m] of row m = program_id(0): dynamic (a pass for the absmax, one to
    quantize), or static (the calibrated scale at static_ptr, one pass)."""
    row = tl.program_id(0)
    code_max: tl.constexpr = _FP8_MAX if FP8 else _INT8_MAX
    code_min: tl.constexpr = -_FP8_MAX if FP8 else _INT8_MIN
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        peak = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            ks = start + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(v))
        scale = tl.max(peak, axis=0) / code_max
        scale = tl.where(scale == 0.0, _SCALE_EPS, scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        ks = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(v / scale, code_min), code_max)
        if FP8:  # noqa: SIM108  (a constexpr branch, resolved when the kernel compiles)
            v = _round_to_e4m3(v)
        else:
            v = (v + ROUND_MAGIC) - ROUND_MAGIC
        tl.store(codes_ptr + row * stride_cm + ks, v.to(codes_ptr.dtype.element_ty), mask=ks < K)


@triton.jit
def _w8a8_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, out_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on,
    FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K, ATOMIC: tl.constexpr,
):  # fmt: skip
    """out[M, N] = (a @ b^T) * a_scale[:, None] * b_scale[None, :] for 8-bit a [M, K], b [N, K].
    Program (m, n, s) owns one output tile and the s-th share of the K tiles; with SPLIT_K > 1
    the scaled shares are added into a float32 `out` atomically."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    first, last = k_tile_range(K, BLOCK_K, SPLIT_K)
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for tile in range(first, last):
        ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if FP8:
            acc += tl.dot(a, b)  # a fresh float32 tile sum: see the module docstring
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + cols, mask=col_ok, other=0.0)
    result = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    write_tile(out_ptr, result, rows, cols, row_ok, col_ok, stride_om, stride_on, ATOMIC)


def quantize_rows(
    x: Tensor, fp8: bool, static_scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token codes [M, K] (int8 or float8_e4m3fn) and float32 scales [M] of x [M, K]: from
    each row's range, or every row with `static_scale` (float32 [1]) when given."""
    check_matrix("x", x, ACTIVATION_DTYPES)
    if static_scale is not None and (
        static_scale.numel() != 1 or static_scale.dtype != torch.float32
    ):
        raise InputError("input_scale: expected one float32 value (a static per-tensor scale)")
    m, k = x.shape
    codes = torch.empty(m, k, dtype=FP8_CODES if fp8 else torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = min(QUANT_BLOCK, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](
            x, codes, scale, scale if static_scale is None else static_scale, k,
            x.stride(0), codes.stride(0), FP8=fp8, STATIC=static_scale is not None, BLOCK=block,
        )  # fmt: skip
    return codes, scale


def _check(x: Tensor, weight: W8A8Weight) -> None:
    check_matrix("x", x, ACTIVATION_DTYPES)
    check_matrix("weight.codes", weight.codes, (torch.int8, FP8_CODES))
    check_matrix("weight.scale", weight.scale, (torch.float32,), ndim=1)
    if x.shape[1] != weight.in_features:
        raise InputError(f"x has {x.shape[1]} columns but the weight has {weight.in_features}")
    if weight.scale.shape[0] != weight.out_features:
        raise InputError(
            f"weight.scale: {weight.scale.shape[0]} scales for {weight.out_features} outputs"
        )
    check_same_device(x=x, codes=weight.codes, scale=weight.scale, input_scale=weight.input_scale)


def w8a8_matmul(
    x: Tensor,
    weight: W8A8Weight,
    *,
    config: TileConfig | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """y = quantize(x) @ W^T with both scales applied, for x [M, K] in float16/bfloat16 (float32
    allowed) and an int8 or FP8 weight [N, K]; activation quantization included."""
    _check(x, weight)
    if out is None:
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype, device=x.device)
    codes, x_scale = quantize_rows(x, weight.is_fp8, weight.input_scale)
    return w8a8_gemm(codes, x_scale, weight, config=config, out=out)


def w8a8_gemm(
    codes: Tensor,
    x_scale: Tensor,
    weight: W8A8Weight,
    *,
    config: TileConfig | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """The GEMM of `w8a8_matmul` alone, on activations already quantized (`quantize_rows`'s
    codes [M, K] and float32 scales [M]): what a benchmark holds against `torch._scaled_mm`
    and `torch._int_mm`, which take quantized operands. `out` defaults to bfloat16 [M, N]."""
    m, n, k = codes.shape[0], weight.out_features, weight.in_features
    config = config or choose_config(m, n, k, weight.is_fp8, codes.device)
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=codes.device)
    target = out if config.split_k == 1 else torch.zeros(m, n, dtype=torch.float32, device=codes.device)  # fmt: skip
    grid = (cdiv(m, config.block_m), cdiv(n, config.block_n), config.split_k)
    w = weight.codes
    _w8a8_kernel[grid](
        codes, w, x_scale, weight.scale, target, m, n, k,
        codes.stride(0), codes.stride(1), w.stride(0), w.stride(1),
        target.stride(0), target.stride(1),
        FP8=weight.is_fp8, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=config.split_k, ATOMIC=config.split_k > 1,
        num_warps=config.num_warps, num_stages=launch_stages(config),
    )  # fmt: skip
    return out if target is out else out.copy_(target)
