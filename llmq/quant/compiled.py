"""RTN's and GPTQ's per-value loops compiled for the CPU (numba): the same arithmetic as their
torch ops, without a dispatch per op.

On a CPU the torch versions cost their op count, not their arithmetic:
- GPTQ's column loop (`llmq.quant.gptq._quantize_columns`) spends six to seven ops a column,
  each a few microseconds, so the 2,688 columns of a SmolLM2-135M layer (q/k/v, o, gate/up and
  down, each stacked with the linears sharing its input) took 0.5 s of an ~8 s GPTQ layer on
  two cores, against ~0.1 GFLOP of arithmetic.
- The clipping search (`llmq.quant.rtn.clip_ratios`) quantizes and dequantizes the whole
  weight once per shrink factor, some ten whole-weight passes each.

Each step rounds as the torch ops do: codes are computed in float64 (the division, the zero
point added, rounded half to even, clamped), dequantized in float64 and rounded once to the
working dtype, and GPTQ spreads a residual with one fused multiply-add per weight (torch's CPU
`addr_` fuses its vectorised part). tests/quant/test_compiled.py checks that the results are
bit-identical on real weights. Compiled on first use and cached on disk.
"""

from __future__ import annotations

import numpy
import torch
from numba import njit
from torch import Tensor

_TILE = 256  # rows per tile: 128 block columns x 256 rows of float32 is 128 KB, in L2


def compiled_loop_applies(values: Tensor, integer_codes: bool) -> bool:
    """The compiled loops serve integer codes of contiguous float32 or float64 values on the
    CPU; FP8 codes (a cast does the rounding) and other devices keep the torch ops."""
    return (
        integer_codes
        and values.device.type == "cpu"
        and values.dtype in (torch.float32, torch.float64)
        and values.is_contiguous()
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
    pruned: Tensor | None = None,
) -> None:
    """GPTQ over columns first .. first + len(scale) of `block`, in place.

    block [columns, rows]: the weights transposed (a column is a contiguous row), updated in
        place: every later column of the block receives each quantized column's residual.
    spread [columns, columns]: row i is Hinv[i, j] / Hinv[i, i].
    scale, dequant_scale [segment, rows] float64: each column's scale, and the scale as the
        working dtype holds it; zero [segment, rows] float64 or None (symmetric).
    codes [columns, rows] float64 and residuals [columns, rows] (block's dtype): written for
        the segment's columns.
    pruned [columns, rows] bool or None: weights that get the code of zero (SparseGPT).
    """
    mask = numpy.zeros((1, 1), numpy.bool_) if pruned is None else pruned.numpy()
    _quantize_columns(
        block.numpy(), spread.numpy(), first, scale.numpy(), *_zero_point(zero, scale),
        dequant_scale.numpy(), *_code_bounds(code_range), codes.numpy(), residuals.numpy(),
        mask, pruned is not None,
    )  # fmt: skip


def clip_deltas(
    groups: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    dequant_scale: Tensor,
    code_range: tuple[int, int],
    deltas: Tensor,
) -> None:
    """deltas[g, r] = dequantize(quantize(groups[r, g])) - groups[r, g]: the rounding error of
    each group under its own scale, written group-major for one batched product per group.

    groups [rows, groups, n] float32; scale [rows, groups] float64 (the divisor of the codes),
    dequant_scale [rows, groups] float64 (the scale as float32 holds it), zero [rows, groups]
    float64 or None; deltas [groups, rows, n] float32.
    """
    _clip_deltas(
        groups.numpy(), scale.numpy(), *_zero_point(zero, scale),
        dequant_scale.numpy(), *_code_bounds(code_range), deltas.numpy(),
    )  # fmt: skip


def _zero_point(zero: Tensor | None, scale: Tensor) -> tuple[numpy.ndarray, bool]:
    """(zero points, whether there are any): a compiled function takes one array type, so a
    symmetric scheme passes its scales in the zero points' place, never read."""
    return (scale if zero is None else zero).numpy(), zero is not None


def _code_bounds(code_range: tuple[int, int]) -> tuple[float, float]:
    low, high = code_range
    return float(low), float(high)


@njit(nogil=True, cache=True)
def _quantize_columns(
    block,
    spread,
    first,
    scale,
    zero,
    has_zero,
    dequant_scale,
    low,
    high,
    codes,
    residuals,
    pruned,
    has_mask,
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
                if has_mask and pruned[column, r]:  # the code that dequantizes to exactly 0
                    code = zero[j, r] if has_zero else 0.0
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


@njit(nogil=True, cache=True)
def _clip_deltas(
    groups, scale, zero, has_zero, dequant_scale, low, high, deltas
):  # pragma: no cover - compiled
    rows, count, width = groups.shape
    for r in range(rows):
        for g in range(count):
            divisor, multiplier = scale[r, g], dequant_scale[r, g]
            for k in range(width):
                value = groups[r, g, k]
                code = value / divisor  # float64
                if has_zero:
                    code += zero[r, g]
                code = min(max(numpy.rint(code), low), high)
                if has_zero:
                    code -= zero[r, g]
                deltas[g, r, k] = numpy.float32(code * multiplier) - value
