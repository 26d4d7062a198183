"""GPTQ's column loop on a GPU in one kernel launch per block of columns.

In torch ops each column of a block costs six or seven launches (divide, round, clamp,
dequantize, residual, the rank-1 update of the later columns): a Llama-3-8B layer has 26,624
columns to visit, so on an H200 the loop is bound by launch latency (about a second a layer),
not by its arithmetic. Here one program holds a tile of rows for all the block's columns in
registers and runs the whole loop on them; the block's columns are independent across rows, so
the programs never talk to each other.

The arithmetic is `llmq.quant.compiled._quantize_columns`' (the CPU loop): a code is the weight
divided by its scale in float64, plus the zero point, clamped and rounded half to even; the
dequantized value is rounded once to float32, and the residual spread over the later columns
with one fused multiply-add per weight, so the codes are the CPU loop's bit for bit (tested in
the interpreter). Rounding uses the float64 magic number (1.5 * 2**52), exact
after the clamp, because the interpreter's `rint` is broken and tests run there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROUND_MAGIC_F64 = tl.constexpr(6755399441055744.0)  # 1.5 * 2**52
MAX_COLUMNS = 256  # the widest block one program holds in registers
ROWS_PER_PROGRAM = 32


@triton.jit
def _columns_kernel(
    block_ptr,  # [columns, rows] float32, updated in place
    spread_ptr,  # [columns, columns] float32
    scale_ptr,  # [count, rows] float64
    zero_ptr,  # [count, rows] float64 (read only when HAS_ZERO)
    dequant_ptr,  # [count, rows] float64
    codes_ptr,  # [columns, rows] float64
    residuals_ptr,  # [columns, rows] float32
    rows,
    columns,
    first,
    count,
    low,
    high,
    HAS_ZERO: tl.constexpr,
    COLUMNS: tl.constexpr,
    TILE: tl.constexpr,
):
    r = tl.program_id(0) * TILE + tl.arange(0, TILE)
    c = tl.arange(0, COLUMNS)
    row_mask = r < rows
    tile_mask = (c < columns)[:, None] & row_mask[None, :]
    offsets = c[:, None] * rows + r[None, :]
    tile = tl.load(block_ptr + offsets, mask=tile_mask, other=0.0)
    for j in range(count):
        column = first + j
        value = tl.sum(tl.where(c[:, None] == column, tile, 0.0), axis=0)
        scale = tl.load(scale_ptr + j * rows + r, mask=row_mask, other=1.0)
        code = value.to(tl.float64) / scale
        if HAS_ZERO:
            zero = tl.load(zero_ptr + j * rows + r, mask=row_mask, other=0.0)
            code = code + zero
        code = tl.minimum(tl.maximum(code, low), high)
        code = (code + ROUND_MAGIC_F64) - ROUND_MAGIC_F64
        tl.store(codes_ptr + column * rows + r, code, mask=row_mask)
        if HAS_ZERO:
            code = code - zero
        dequant = tl.load(dequant_ptr + j * rows + r, mask=row_mask, other=0.0)
        residual = value - (code * dequant).to(tl.float32)
        tl.store(residuals_ptr + column * rows + r, residual, mask=row_mask)
        later = tl.load(spread_ptr + column * columns + c, mask=c > column, other=0.0)
        tile = tl.fma(-later[:, None], residual[None, :], tile)
    tl.store(block_ptr + offsets, tile, mask=tile_mask)


def gpu_loop_applies(block: Tensor, integer_codes: bool) -> bool:
    """The kernel serves integer codes of a contiguous float32 block on a CUDA device, no
    wider than `MAX_COLUMNS`; the rest keep the torch ops."""
    return (
        integer_codes
        and block.is_cuda
        and block.dtype == torch.float32
        and block.is_contiguous()
        and len(block) <= MAX_COLUMNS
    )


def quantize_columns_gpu(
    block: Tensor,
    spread: Tensor,
    first: int,
    scale: Tensor,
    zero: Tensor | None,
    dequant_scale: Tensor,
    code_range: tuple[int, int],
    codes: Tensor,
    residuals: Tensor,
) -> None:
    """GPTQ over columns first .. first + len(scale) of `block`, in place: the arguments and
    results of `llmq.quant.compiled.quantize_columns` (without a pruning mask)."""
    columns, rows = block.shape
    low, high = code_range
    operands = [spread, scale, dequant_scale] + ([] if zero is None else [zero])
    spread, scale, dequant_scale, *rest = (t.contiguous() for t in operands)
    zero = rest[0] if rest else scale
    _columns_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        block, spread, scale, zero, dequant_scale, codes, residuals,
        rows, columns, first, len(scale), float(low), float(high),
        HAS_ZERO=bool(rest), COLUMNS=triton.next_power_of_2(columns), TILE=ROWS_PER_PROGRAM,
    )  # fmt: skip
