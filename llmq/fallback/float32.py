"""float32: a histogram of the upper halves, then of the lower halves of one bucket.

A float32 has too many distinct values for one histogram, so it is split in two. The first
pass (`float32_summary`) sums the values and counts their upper 16 bits, a bfloat16's pattern:
that histogram finds the bucket that holds each quartile's rank (`float32_first_pass`). The
second pass (`float32_second_pass`) collects the values of those buckets alone, counts the tail
and, for a per-tensor integer scheme, sums the squared error on the grid that `int_grids`
chose for all the batch's float32 tensors in one call. Both passes are compiled
(`llmq.fallback.passes`); this module turns what they return into statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy
import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.fallback import passes
from llmq.fallback.quant_error import quantization_errors, tensor_qparams
from llmq.fallback.quartiles import at_ranks, quantile, quantile_ranks
from llmq.fallback.summary import Moments, TensorStats, finish_stats, tail_bounds
from llmq.quant.primitives import int_range

_BITS = 16  # bucket width of the histograms


@dataclass(frozen=True, slots=True)
class Float32Pass:
    """What the first pass over a float32 tensor leaves for the second."""

    weight: Tensor
    flat: Tensor  # its finite values
    args: QuantArgs | None  # None when a value is not finite
    input_weights: Tensor | None
    moments: Moments
    nan: int
    inf: int
    ranks: list[int]  # the quartiles' order statistics
    rank_buckets: list[int]  # the upper-16-bit bucket that holds each rank
    below_buckets: list[int]  # how many values lie below that bucket
    buckets: list[int]  # those buckets, each once, ascending: the second pass collects them
    members: int  # how many values they hold

    @property
    def per_tensor_int(self) -> bool:
        """Whether the second pass computes the per-tensor integer error: with input weights,
        `quantization_errors` needs each column's error and reads the data again instead."""
        args = self.args
        return (
            args is not None and args.type == "int" and args.strategy == "tensor"
            and self.input_weights is None
        )  # fmt: skip


def float32_first_pass(
    weight: Tensor, summary: Float32Summary, args: QuantArgs | None, input_weights: Tensor | None
) -> Float32Pass:
    """What the second pass needs, from the first pass's `summary` of `weight`'s values (made
    again over the finite values alone when some are not)."""
    flat = weight.reshape(-1)
    nan = inf = 0
    if not math.isfinite(summary.moments.squares):
        nan, inf = int(flat.isnan().sum()), int(flat.isinf().sum())
        flat = flat[flat.isfinite()]  # a copy, in this rare case only
        summary = float32_summary(flat)
    moments, upper = summary.moments, summary.upper
    ranks = quantile_ranks(moments.count)
    # a float32's upper half is a bfloat16: bfloat16's pattern order is the buckets' order
    rank_buckets, below_buckets = at_ranks(upper, ranks) if flat.numel() else ([], [])
    buckets = sorted(set(rank_buckets))
    checked = None if nan + inf else args
    return Float32Pass(
        weight, flat, checked, input_weights, moments, nan, inf, ranks, rank_buckets,
        below_buckets, buckets, int(upper[buckets].sum()),
    )  # fmt: skip


def float32_second_pass(
    first: Float32Pass, int_grid: tuple[float, float, float, float] | None
) -> TensorStats:
    at_rank, tail, int_error = _refine_buckets(first, tail_bounds(first.moments), int_grid)
    q1, q3 = (quantile(first.moments.count, q, at_rank.__getitem__) for q in (0.25, 0.75))
    per_tensor = None if int_grid is None else lambda: int_error
    errors = quantization_errors(
        first.weight, first.moments, first.args, first.input_weights, per_tensor
    )
    return finish_stats(
        first.weight.numel(), first.moments, first.nan, first.inf, q1, q3, tail, errors
    )


@dataclass(frozen=True, slots=True)
class Float32Summary:
    """The first pass over float32 values: their moments (min and max mean nothing, and the sum
    of squares is not finite, when a value is not finite), the histogram of their upper 16
    bits, and whether every value is a bfloat16 (no lower 16 bits set)."""

    moments: Moments
    upper: numpy.ndarray
    bfloat16_valued: bool


def float32_summary(flat: Tensor) -> Float32Summary:
    upper = numpy.zeros(1 << _BITS, dtype=numpy.int64)
    low, high, total, squares, lower_halves_used = passes.float32_summary(flat.numpy(), upper)
    if not flat.numel():
        low = high = 0.0
    moments = Moments(flat.numel(), low, high, total, squares)
    return Float32Summary(moments, upper, bfloat16_valued=not lower_halves_used)


def int_grids(
    firsts: list[Float32Pass], args: QuantArgs | None
) -> list[tuple[float, float, float, float] | None]:
    """For each tensor whose second pass computes the per-tensor integer error: (scale, zero
    point, lowest code, highest code), chosen by `quantize`'s own `choose_qparams` (the scale
    rounded to float32) in one call for all of them; None for the others."""
    wanted = [first for first in firsts if first.per_tensor_int]
    if args is None or not wanted:
        return [None] * len(firsts)
    scales, zeros = tensor_qparams([first.moments for first in wanted], args, torch.float32)
    zero_points = [0.0] * len(wanted) if zeros is None else zeros.tolist()
    lowest, highest = map(float, int_range(args.num_bits))
    grids = iter(zip(scales.tolist(), zero_points, strict=True))
    return [(*next(grids), lowest, highest) if first.per_tensor_int else None for first in firsts]


def _refine_buckets(
    first: Float32Pass,
    tail_bounds: tuple[float, float],
    int_grid: tuple[float, float, float, float] | None,
) -> tuple[dict[int, float], int, float]:
    """Values at the quartile ranks, the count outside `tail_bounds` and the squared per-tensor
    integer error under `int_grid` (0.0 without one), from one pass that keeps only the
    members of the upper-half buckets that hold those ranks."""
    if not first.flat.numel():
        return dict.fromkeys(first.ranks, 0.0), 0, 0.0
    members = numpy.empty(first.members, dtype=numpy.float32)
    tail, error, _ = passes.float32_refine(
        first.flat.numpy(), first.buckets, members, tail_bounds, int_grid
    )
    positions = [k - below for k, below in zip(first.ranks, first.below_buckets, strict=True)]
    values = passes.select_in_buckets(members, first.rank_buckets, positions)
    return dict(zip(first.ranks, values, strict=True)), tail, error
