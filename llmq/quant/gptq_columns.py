"""GPTQ's column loop compiled for the CPU (numba): the same arithmetic as the torch loop in
`llmq.quant.gptq._quantize_block`, without an op dispatch per column.

On a CPU the torch loop's cost is its op count, not its arithmetic: six to seven ops a column,
each a few microseconds of dispatch, so the 2,688 columns of a SmolLM2-135M layer (q/k/v, o,
gate/up and down, each stacked with the linears sharing its input) took 0.5 s of an ~8 s GPTQ
layer on two cores, against ~0.1 GFLOP of arithmetic. Compiled, rows are handled in tiles whose
block columns stay in the L2 cache.

Each step rounds as the torch loop does: codes are computed in float64 (the division, the zero
point added, rounded half to even, clamped), dequantized in float64 and rounded once to the
working dtype, and a residual is spread with one fused multiply-add per weight (torch's CPU
`addr_` fuses its vectorised part). The codes are those of the torch loop: tests/quant/
test_gptq_columns.py checks them on real weights. Compiled on first use and cached on disk.
"""

from __future__ import annotations

import numpy
import torch
from numba import njit
from torch import Tensor

_TILE = 256  # rows per tile: 128 block columns x 256 rows of float32 is 128 KB, in L2


def compiled_loop_applies(block: Tensor, integer_codes: bool) -> bool:
    """The compiled loop serves integer codes on the CPU in float32 or float64; FP8 codes (a
    cast does the rounding) and other devices keep the torch loop."""
    return (
        integer_codes
        and block.device.type == "cpu"
        and block.dtype in (torch.float32, torch.float64)
        and block.is_contiguous()
    )


def quantize_columns(
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
    """GPTQ over columns first .. first + len(scale) of `block`, in place.

    block [columns, rows]: the weights transposed (a column is a contiguous row), updated in
        place: every later column of the block receives each quantized column's residual.
    spread [columns, columns]: row i is Hinv[i, j] / Hinv[i, i].
    scale, dequant_scale [segment, rows] float64: each column's scale, and the scale as the
        working dtype holds it; zero [segment, rows] float64 or None (symmetric).
    codes [columns, rows] float64 and residuals [columns, rows] (block's dtype): written for
        the segment's columns.
    """
    has_zero = zero is not None
    low, high = code_range
    _quantize_columns(
        block.numpy(), spread.numpy(), first, scale.numpy(), (zero if has_zero else scale).numpy(),
        has_zero, dequant_scale.numpy(), float(low), float(high), codes.numpy(), residuals.numpy(),
    )  # fmt: skip


@njit(nogil=True, cache=True)
def _quantize_columns(
    block, spread, first, scale, zero, has_zero, dequant_scale, low, high, codes, residuals
):  # pragma: no cover - compiled
    rows = block.shape[1]
    dequantized = numpy.empty(_TILE, block.dtype)
    for tile in range(0, rows, _TILE):
        end = min(tile + _TILE, rows)
        for j in range(scale.shape[0]):
            column = first + j
            for r in range(tile, end):
                value = block[column, r]
                code = value / scale[j, r]  # float64
                if has_zero:
                    code += zero[j, r]
                code = min(max(numpy.rint(code), low), high)
                codes[column, r] = code
                if has_zero:
                    code -= zero[j, r]
                dequantized[r - tile] = code * dequant_scale[j, r]  # rounded to the working dtype
                residuals[column, r] = value - dequantized[r - tile]
            _spread_residual(block, spread, residuals, column, tile, end)


@njit(nogil=True, cache=True, fastmath={"contract"})
def _spread_residual(block, spread, residuals, column, tile, end):  # pragma: no cover - compiled
    """block[later, tile:end] -= spread[column, later] · residuals[column, tile:end] for every
    later column, one fused multiply-add per value (`contract`; the only flag here, so that no
    other step of the loop is fused)."""
    residual = residuals[column, tile:end]
    for later in range(column + 1, block.shape[0]):
        weight, target = -spread[column, later], block[later, tile:end]
        for r in range(target.size):
            target[r] = target[r] + weight * residual[r]
