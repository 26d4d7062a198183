"""W4A16: int4 weights (compressed-tensors pack-quantized) times float16/bfloat16 activations.

    y[M, N] = x[M, K] @ W^T,   W[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)]

FP4 weights (NVFP4, MXFP4 without activation quantization: GPUs without FP4 tensor cores) take
the same path with E2M1 codes decoded from the nibbles in registers (`W4A16Weight.fp4`).

Weights stay packed in memory, eight codes per int32 word along K exactly as `llmq quantize`
writes them (`llmq.pack.layout.W4A16Weight`); a tile is unpacked, shifted and scaled in
registers and multiplied in the activation dtype with a float32 accumulator. Three paths, chosen
by `choose_config` (a measured table per GPU, else a rule by M; see there for why):
- decode (M <= 16): split-K, so that a thin product still keeps every SM streaming weights; one
  row (batch-1 decode) is a plain dot product, 16 rows use tensor-core tiles;
- tiled (16 < M < 256): the same kernel with larger tiles, dequantization fused in;
- dequant (M >= 256): dequantize into a 16-bit buffer, then torch.matmul (cuBLAS wins there).
Act-order checkpoints (`weight_g_idx`) take the group of each input column from g_idx.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llmq.errors import InputError
from llmq.kernels.support import (
    DECODE_MAX_M,
    DECODE_WAVES,
    TileConfig,
    cdiv,
    check_matrix,
    check_same_device,
    dot_dtype,
    launch_stages,
    split_for,
)
from llmq.kernels.tiles import k_tile_range, write_tile
from llmq.kernels.tuning import tuned_config
from llmq.pack.layout import INT4_PER_WORD, W4A16Weight

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEQUANT_MIN_M = 256  # from here on the product is compute-bound: cuBLAS on dequantized weights
GEMV_WAVES = 8  # one-row products: K split until about 8 programs per SM (the H200 table's)
_TORCH_TO_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def choose_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> TileConfig:
    """The launch for one product: the measured table for this GPU when there is one
    (llmq.kernels.tuning), else the built-in rule by M, which follows what the H200 table chose:
    one row streams the weights through a plain dot product (twice as fast there as 16-row
    tensor-core tiles), up to 16 rows split K, up to 255 tiles of 64 x 64 with K split, and from
    M = 256 on dequantize + cuBLAS (no fused int4 tile measured came near it)."""
    tuned = tuned_config("w4a16", m, n, k, device, max_block_k=group_size)
    if tuned is not None:
        return tuned
    block_k = min(128, group_size)
    if m == 1:
        split = split_for(GEMV_WAVES, m, n, k, 1, 128, block_k, device)
        return TileConfig("decode", 1, 128, block_k, split_k=split, num_stages=3)
    if m <= DECODE_MAX_M:
        split = split_for(DECODE_WAVES, m, n, k, 16, 128, block_k, device)
        return TileConfig("decode", 16, 128, block_k, split_k=split, num_stages=4)
    if m < DEQUANT_MIN_M:
        split = split_for(DECODE_WAVES, m, n, k, 64, 64, block_k, device)
        return TileConfig("tiled", 64, 64, block_k, split_k=split, num_stages=4)
    return TileConfig("dequant", 0, 64, block_k)


@triton.jit
def _dequantize_tile(
    packed_ptr, scale_ptr, zero_ptr, g_idx_ptr, tile, cols, col_ok, K,
    stride_pn, stride_pw, stride_sn, stride_sg,
    GROUP_SIZE: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_G_IDX: tl.constexpr,
    FP4: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Float32 weights [BLOCK_K, BLOCK_N] of K-tile `tile` for output columns `cols`."""
    WORDS: tl.constexpr = BLOCK_K // 8
    words_k = tile * WORDS + tl.arange(0, WORDS)
    words = tl.load(
        packed_ptr + words_k[:, None] * stride_pw + cols[None, :] * stride_pn,
        mask=(words_k[:, None] * 8 < K) & col_ok[None, :],
        other=0,
    )
    shifts = tl.arange(0, 8) * 4
    fields = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [WORDS, 8, BLOCK_N]
    fields = tl.reshape(fields, (BLOCK_K, BLOCK_N))
    if FP4:  # E2M1: exponent e = bits 1-2, mantissa m = bit 0: m / 2 where e = 0, else
        # (1 + m / 2) · 2^(e - 1); bit 3 the sign
        exponent = (fields >> 1) & 0x3
        mantissa = (fields & 0x1).to(tl.float32)
        normal = (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32))
        magnitude = tl.where(exponent == 0, 0.5 * mantissa, normal)
        w = tl.where(fields >= 8, -magnitude, magnitude)
    else:
        w = (fields - 8).to(tl.float32)
    if HAS_G_IDX:
        ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        groups = tl.load(g_idx_ptr + ks, mask=k_ok, other=0)
        offsets = groups[:, None] * stride_sg + cols[None, :] * stride_sn
        ok = k_ok[:, None] & col_ok[None, :]
        if HAS_ZERO:
            w -= tl.load(zero_ptr + offsets, mask=ok, other=0).to(tl.float32)
        w *= tl.load(scale_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    else:  # BLOCK_K divides GROUP_SIZE: one scale per column for the whole tile
        offsets = (tile * BLOCK_K // GROUP_SIZE) * stride_sg + cols * stride_sn
        if HAS_ZERO:
            w -= tl.load(zero_ptr + offsets, mask=col_ok, other=0).to(tl.float32)[None, :]
        w *= tl.load(scale_ptr + offsets, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return w


@triton.jit
def _w4a16_kernel(
    x_ptr, packed_ptr, scale_ptr, zero_ptr, g_idx_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_pn, stride_pw, stride_sn, stride_sg, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_G_IDX: tl.constexpr,
    FP4: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K, ATOMIC: tl.constexpr,
):  # fmt: skip
    """out[M, N] = x @ W^T. Program (m, n, s) owns one output tile and the s-th share of the K
    tiles; with SPLIT_K > 1 the shares are added into a float32 `out` atomically."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    first, last = k_tile_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(first, last):
        ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        w = _dequantize_tile(
            packed_ptr, scale_ptr, zero_ptr, g_idx_ptr, tile, cols, col_ok, K,
            stride_pn, stride_pw, stride_sn, stride_sg,
            GROUP_SIZE, HAS_ZERO, HAS_G_IDX, FP4, BLOCK_K, BLOCK_N,
        )  # fmt: skip
        if BLOCK_M == 1:  # one row (batch-1 decode): a plain dot product, no tensor cores
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
        else:
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE))
    write_tile(out_ptr, acc, rows, cols, row_ok, col_ok, stride_om, stride_on, ATOMIC)


@triton.jit
def _dequantize_kernel(
    packed_ptr, scale_ptr, zero_ptr, g_idx_ptr, out_ptr, N, K,
    stride_pn, stride_pw, stride_sn, stride_sg, stride_on, stride_ok,
    GROUP_SIZE: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_G_IDX: tl.constexpr,
    FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[N, K] = W in out's dtype, one [BLOCK_K, BLOCK_N] tile per program."""
    tile = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = _dequantize_tile(
        packed_ptr, scale_ptr, zero_ptr, g_idx_ptr, tile, cols, col_ok, K,
        stride_pn, stride_pw, stride_sn, stride_sg,
        GROUP_SIZE, HAS_ZERO, HAS_G_IDX, FP4, BLOCK_K, BLOCK_N,
    )  # fmt: skip
    ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (ks[:, None] < K) & col_ok[None, :]
    offsets = cols[None, :] * stride_on + ks[:, None] * stride_ok
    tl.store(out_ptr + offsets, w.to(out_ptr.dtype.element_ty), mask=ok)


def _check(x: Tensor, weight: W4A16Weight) -> None:
    check_matrix("x", x, ACTIVATION_DTYPES)
    check_matrix("weight.packed", weight.packed, (torch.int32,))
    k = weight.in_features
    if x.shape[1] != k:
        raise InputError(f"x has {x.shape[1]} columns but the weight has {k} inputs")
    if weight.packed.shape[1] != cdiv(k, INT4_PER_WORD):
        raise InputError(
            f"weight.packed: {weight.packed.shape[1]} words per row for {k} inputs "
            f"(expected {cdiv(k, INT4_PER_WORD)})"
        )
    groups = 1 if weight.group_size >= k else cdiv(k, weight.group_size)
    if weight.g_idx is None and tuple(weight.scale.shape) != (weight.out_features, groups):
        raise InputError(
            f"weight.scale: shape {tuple(weight.scale.shape)}, expected "
            f"({weight.out_features}, {groups}) for group size {weight.group_size}"
        )
    if weight.zero is not None and weight.zero.shape != weight.scale.shape:
        raise InputError(f"weight.zero: shape {tuple(weight.zero.shape)} is not the scale's")
    if weight.group_size < k and weight.group_size % 16:
        raise InputError(f"group size {weight.group_size}: the kernel needs a multiple of 16")
    check_same_device(x=x, packed=weight.packed, scale=weight.scale, zero=weight.zero)


def _weight_args(weight: W4A16Weight, block_k: int) -> tuple[list[object], dict[str, object]]:
    """Pointer/stride arguments and constexprs describing the packed weight to both kernels."""
    scale = weight.scale.contiguous()
    zero = weight.zero.contiguous() if weight.zero is not None else scale  # unread placeholder
    g_idx = weight.g_idx.to(torch.int32) if weight.g_idx is not None else weight.packed
    per_channel = weight.group_size >= weight.in_features
    # Per channel every tile reads scale column 0: group stride 0, any group size.
    stride_sg = 0 if per_channel else scale.stride(1)
    pointers = [weight.packed, scale, zero, g_idx]
    strides = [weight.packed.stride(0), weight.packed.stride(1), scale.stride(0), stride_sg]
    constexprs = {
        "GROUP_SIZE": block_k if per_channel else weight.group_size,
        "HAS_ZERO": weight.zero is not None,
        "HAS_G_IDX": weight.g_idx is not None,
        "FP4": weight.fp4,
    }
    return [*pointers, strides], constexprs


def dequantize(weight: W4A16Weight, dtype: torch.dtype, block_k: int = 64) -> Tensor:
    """The weight [out, in] in `dtype`, dequantized on the device by one kernel."""
    n, k = weight.out_features, weight.in_features
    block_k = min(block_k, weight.group_size) if weight.group_size < k else block_k
    out = torch.empty(n, k, dtype=dtype, device=weight.packed.device)
    (*pointers, strides), constexprs = _weight_args(weight, block_k)
    grid = (cdiv(k, block_k), cdiv(n, 64))
    _dequantize_kernel[grid](
        *pointers, out, n, k, *strides, out.stride(0), out.stride(1),
        BLOCK_N=64, BLOCK_K=block_k, **constexprs,
    )  # fmt: skip
    return out


def w4a16_matmul(
    x: Tensor,
    weight: W4A16Weight,
    *,
    config: TileConfig | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """y = x @ W^T for x [M, K] (float16/bfloat16; float32 allowed), W a packed int4 weight
    [N, K]. `config` overrides the dispatch (tests, tuning); `out` [M, N] receives the result."""
    _check(x, weight)
    m, n, k = x.shape[0], weight.out_features, weight.in_features
    config = config or choose_config(m, n, k, weight.group_size, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if config.path == "dequant":
        w = dequantize(weight, dot_dtype(x.dtype), config.block_k)
        return out.copy_(x.to(w.dtype) @ w.T)
    target = out if config.split_k == 1 else torch.zeros(m, n, dtype=torch.float32, device=x.device)
    (*pointers, strides), constexprs = _weight_args(weight, config.block_k)
    grid = (cdiv(m, config.block_m), cdiv(n, config.block_n), config.split_k)
    _w4a16_kernel[grid](
        x, *pointers, target, m, n, k, x.stride(0), x.stride(1), *strides,
        target.stride(0), target.stride(1),
        DOT_DTYPE=_TORCH_TO_TL[dot_dtype(x.dtype)], BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k, ATOMIC=config.split_k > 1,
        num_warps=config.num_warps, num_stages=launch_stages(config),
        **constexprs,
    )  # fmt: skip
    return out if target is out else out.copy_(target)
