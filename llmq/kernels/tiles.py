"""Triton helpers every GEMM kernel here shares: which K tiles a split-K program owns, and how an
output tile is written (stored, or added atomically when K is split)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def k_tile_range(K, BLOCK_K: tl.constexpr, SPLIT_K):
    """[first, last) of the K tiles program_id(2) owns: the s-th of SPLIT_K equal shares.
    SPLIT_K is a run-time value, so one compiled kernel serves every split of a tile config."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = tl.program_id(2) * per_split
    return first, tl.minimum(first + per_split, k_tiles)


@triton.jit
def write_tile(
    out_ptr, tile, rows, cols, row_ok, col_ok, stride_om, stride_on, ATOMIC: tl.constexpr
):
    """Store a float32 tile in out's dtype, or (ATOMIC: K is split) add it to a float32 `out`."""
    offsets = rows[:, None] * stride_om + cols[None, :] * stride_on
    ok = row_ok[:, None] & col_ok[None, :]
    if not ATOMIC:
        tl.store(out_ptr + offsets, tile.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out_ptr + offsets, tile, mask=ok)
