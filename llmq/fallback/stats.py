"""Exact statistics of one weight tensor: no sort, no sampling, no upcast copy.

Quartiles come from histograms of bit patterns. A 16-bit (or 8-bit) float has at most 65,536
distinct values, so one `bincount` over its bit patterns is the whole distribution: every order
statistic, the mean, the standard deviation and the tail counts follow from the 65,536 counts, and
so does the per-tensor quantization error (the error of a value depends on the value alone).
A float32 is split in two: a histogram of its upper 16 bits finds the bucket that holds a wanted
rank, and a second pass collects the values of that bucket alone. The passes over the values are
compiled (`llmq.fallback.passes`); this module turns their counts into statistics, for one
tensor (`tensor_stats`) or a batch (`batch_stats`: the scan's, one file's tensors at a time).

Quantiles interpolate linearly between the two nearest order statistics, as `torch.quantile`
does. std is the population standard deviation (divided by n).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import numpy
import torch
from torch import Tensor

from llmq.config import QuantArgs, fit_group_size
from llmq.fallback import passes
from llmq.quant.primitives import (
    ACCUM_DTYPE,
    choose_qparams,
    int_range,
    quantize_grouped,
    quantize_weight,
    scale_codes,
)

CHUNK_ELEMENTS = 1 << 20
"""Elements processed at once: a few MB of working memory, whatever the tensor's size."""
TAIL_SIGMAS = 6.0
_BITS = 16  # bucket width of the histograms

_PATTERN_DTYPES = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}
SUPPORTED_DTYPES = tuple(_PATTERN_DTYPES)


@dataclass(frozen=True, slots=True)
class TensorStats:
    """What the scan reports for one tensor; value statistics cover its finite values."""

    numel: int
    nan: int
    inf: int
    min: float
    max: float
    absmax: float
    mean: float
    std: float
    q1: float
    q3: float
    tail_share: float  # share of values beyond TAIL_SIGMAS standard deviations of the mean
    nrmse: float | None  # ||W - deq(q(W))|| / ||W||, None when not finite or not applicable
    range_nrmse: float | None  # RMSE / (max - min)
    weighted_nrmse: float | None = None  # with input weights: see tensor_stats
    output_error: float | None = None  # with input weights: sum_j ||dW_:j||^2 w_j

    @property
    def spread_ratio(self) -> float:
        return spread_ratio(self.min, self.max, self.q1, self.q3)


def spread_ratio(low: float, high: float, q1: float, q3: float) -> float:
    """(max - min) / (Q3 - Q1): large means a few values far outside the bulk (inf when the
    bulk is one value and the rest is not)."""
    spread, iqr = high - low, q3 - q1
    if iqr > 0:
        return spread / iqr
    return math.inf if spread > 0 else 0.0


@dataclass(frozen=True, slots=True)
class _Moments:
    """Count, min, max, sum and sum of squares of the finite values."""

    count: int
    min: float
    max: float
    total: float
    squares: float

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        if not self.count:
            return 0.0
        return math.sqrt(max(self.squares / self.count - self.mean**2, 0.0))


def tensor_stats(
    weight: Tensor, args: QuantArgs | None, *, input_weights: Tensor | None = None
) -> TensorStats:
    """Exact statistics of `weight` (a CPU tensor of any shape and a dtype of SUPPORTED_DTYPES:
    the scan reads memory-mapped files, and part of the work runs in numpy) and, when `args`
    is given, its quantization error under `args` (rows: every dimension but the last).

    input_weights [in]: how much each input channel matters, e.g. E[x_j^2] on calibration data;
    gives `output_error` = sum_j ||dW_:j||^2 w_j, the diagonal approximation of the squared
    output error per token E||dW x||^2, and `weighted_nrmse` = sqrt(output_error /
    sum_j ||W_:j||^2 w_j), its approximation of ||dW X|| / ||W X||."""
    return batch_stats([weight], args, input_weights=[input_weights])[0]


def batch_stats(
    weights: Sequence[Tensor],
    args: QuantArgs | None,
    *,
    input_weights: Sequence[Tensor | None] | None = None,
) -> list[TensorStats]:
    """`tensor_stats` of each of `weights` (with its `input_weights`, if given). The float32
    tensors' per-tensor grids come from one `choose_qparams` call for all of them: called per
    tensor, its dozen small torch ops cost ~0.1 ms each time and hand the GIL to the other
    scan workers and back (a scan of the default model took 7-15% longer that way)."""
    if input_weights is None:
        input_weights = [None] * len(weights)
    results: dict[int, TensorStats] = {}
    pending: list[tuple[int, _Float32Pass]] = []  # float32 tensors between their two passes
    for index, (weight, channel_weights) in enumerate(zip(weights, input_weights, strict=True)):
        if weight.dtype not in _PATTERN_DTYPES:
            raise ValueError(f"unsupported dtype {weight.dtype}")
        channel_weights = _matching_input_weights(weight, channel_weights)
        if weight.element_size() <= 2:
            results[index] = _small_float_stats(weight, args, channel_weights)
            continue
        summary = _float32_summary(weight.reshape(-1))
        if summary.bfloat16_valued:  # a bf16 checkpoint saved as fp32: the histogram is exact
            results[index] = _histogram_stats(
                weight, summary.upper, torch.bfloat16, args, channel_weights
            )
        else:
            pending.append((index, _float32_first_pass(weight, summary, args, channel_weights)))
    grids = _int_grids([first for _, first in pending], args)
    for (index, first), grid in zip(pending, grids, strict=True):
        results[index] = _float32_second_pass(first, grid)
    return [results[index] for index in range(len(weights))]


def load_passes() -> None:
    """Load every compiled pass now: a process's first compiled call starts LLVM (~0.4 s), and
    each pass then loads from numba's disk cache (~10 ms). One tiny tensor of each path."""
    for dtype in (torch.float32, torch.bfloat16):
        tensor_stats(
            torch.linspace(-1.0, 1.0, 8).to(dtype), QuantArgs(num_bits=8, strategy="tensor")
        )


def _matching_input_weights(weight: Tensor, input_weights: Tensor | None) -> Tensor | None:
    """`input_weights`, or None when they are not this tensor's inputs (a 1-D tensor, another
    width)."""
    if input_weights is not None and (weight.ndim < 2 or input_weights.numel() != weight.shape[-1]):
        return None
    return input_weights


# --- 8- and 16-bit floats: one histogram is the whole distribution ---------------------------


@cache
def _pattern_values(dtype: torch.dtype) -> numpy.ndarray:
    """Every bit pattern's value (float64)."""
    bits = torch.finfo(dtype).bits
    patterns = torch.arange(1 << bits, dtype=torch.int64)
    as_signed = torch.where(patterns >= 1 << (bits - 1), patterns - (1 << bits), patterns)
    return as_signed.to(_PATTERN_DTYPES[dtype]).view(dtype).to(torch.float64).numpy()


def _at_ranks(counts: numpy.ndarray, ranks: list[int]) -> tuple[list[int], list[int]]:
    """For each 0-based rank: the pattern holding the value at that rank, and how many
    values lie in the patterns below it (`counts` of sign-magnitude float patterns)."""
    patterns, below = passes.patterns_at_ranks(counts, numpy.asarray(ranks))
    return patterns.tolist(), below.tolist()


def _pattern_histogram(weight: Tensor) -> numpy.ndarray:
    """Counts of each unsigned bit pattern of an 8- or 16-bit float tensor."""
    bits = torch.finfo(weight.dtype).bits
    patterns = weight.reshape(-1).view(_PATTERN_DTYPES[weight.dtype]).numpy()
    counts = numpy.zeros(1 << bits, dtype=numpy.int64)
    passes.pattern_histogram(patterns.view(numpy.uint16 if bits == 16 else numpy.uint8), counts)
    return counts


def _small_float_stats(
    weight: Tensor, args: QuantArgs | None, input_weights: Tensor | None
) -> TensorStats:
    counts = _pattern_histogram(weight)
    return _histogram_stats(weight, counts, weight.dtype, args, input_weights)


def _histogram_stats(
    weight: Tensor,
    counts: numpy.ndarray,
    table: torch.dtype,
    args: QuantArgs | None,
    input_weights: Tensor | None,
) -> TensorStats:
    """Everything from the counts of each bit pattern of `table`, a dtype holding every value
    of `weight` exactly; only per-channel and per-group errors read the data again. In numpy:
    a few microseconds an operation on these small arrays, where torch takes ten."""
    values = _pattern_values(table)
    occupied = (counts != 0).nonzero()[0]  # the only pass over all patterns (6x flatnonzero)
    occupied_values, occupied_counts = values[occupied], counts[occupied]
    nan = int(occupied_counts[numpy.isnan(occupied_values)].sum())
    inf = int(occupied_counts[numpy.isinf(occupied_values)].sum())
    finite = numpy.isfinite(occupied_values)
    present, multiplicity = occupied_values[finite], occupied_counts[finite].astype(numpy.float64)
    moments = _Moments(
        count=int(multiplicity.sum()),
        min=float(present.min()) if present.size else 0.0,
        max=float(present.max()) if present.size else 0.0,
        total=float(present @ multiplicity),
        squares=float((present * present) @ multiplicity),
    )
    finite_counts = counts
    if nan + inf:
        finite_counts = numpy.zeros_like(counts)
        finite_counts[occupied[finite]] = occupied_counts[finite]
    ranks = _quantile_ranks(moments.count)
    patterns, _ = _at_ranks(finite_counts, ranks)
    at_rank = {k: float(values[pattern]) for k, pattern in zip(ranks, patterns, strict=True)}
    q1, q3 = (_quantile(moments.count, q, at_rank.__getitem__) for q in (0.25, 0.75))
    low, high = _tail_bounds(moments)
    tail = int(multiplicity[(present < low) | (present > high)].sum())
    errors = _quantization_errors(
        weight, moments, None if nan + inf else args, input_weights,
        lambda: _value_error(
            torch.from_numpy(present), torch.from_numpy(multiplicity), moments, args, weight.dtype
        ),
    )  # fmt: skip
    return _finish(weight.numel(), moments, nan, inf, q1, q3, tail, errors)


def _value_error(
    values: Tensor, counts: Tensor, moments: _Moments, args: QuantArgs, dtype: torch.dtype
) -> float:
    """Per-tensor quantization error from the distinct values: each value's error times its
    count. The codes come from the same primitives as `quantize`."""
    scale, zero = _tensor_qparams([moments], args, dtype)
    codes = quantize_grouped(values.view(1, 1, -1), scale.view(1, 1), _view11(zero), args)
    restored = scale_codes(codes, scale, zero).to(torch.float64).view(-1)  # as quantize reads back
    return float(((values - restored).square() * counts).sum())


def _quantile(count: int, q: float, value_at_rank: object) -> float:
    """torch.quantile's linear interpolation between the order statistics around q·(n-1)."""
    if count == 0:
        return 0.0
    position = q * (count - 1)
    below = math.floor(position)
    low = value_at_rank(below)  # type: ignore[operator]
    if position == below:
        return float(low)
    high = value_at_rank(below + 1)  # type: ignore[operator]
    return float(low + (high - low) * (position - below))


def _tail_bounds(moments: _Moments) -> tuple[float, float]:
    spread = TAIL_SIGMAS * moments.std
    return moments.mean - spread, moments.mean + spread


# --- float32: a histogram of the upper halves, then of the lower halves of one bucket ------


@dataclass(frozen=True, slots=True)
class _Float32Pass:
    """What the first pass over a float32 tensor leaves for the second."""

    weight: Tensor
    flat: Tensor  # its finite values
    args: QuantArgs | None  # None when a value is not finite
    input_weights: Tensor | None
    moments: _Moments
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
        `_quantization_errors` needs each column's error and reads the data again instead."""
        args = self.args
        return (
            args is not None and args.type == "int" and args.strategy == "tensor"
            and self.input_weights is None
        )  # fmt: skip


def _float32_first_pass(
    weight: Tensor, summary: _Float32Summary, args: QuantArgs | None, input_weights: Tensor | None
) -> _Float32Pass:
    """What the second pass needs, from the first pass's `summary` of `weight`'s values (made
    again over the finite values alone when some are not)."""
    flat = weight.reshape(-1)
    nan = inf = 0
    if not math.isfinite(summary.moments.squares):
        nan, inf = int(flat.isnan().sum()), int(flat.isinf().sum())
        flat = flat[flat.isfinite()]  # a copy, in this rare case only
        summary = _float32_summary(flat)
    moments, upper = summary.moments, summary.upper
    ranks = _quantile_ranks(moments.count)
    # a float32's upper half is a bfloat16: bfloat16's pattern order is the buckets' order
    rank_buckets, below_buckets = _at_ranks(upper, ranks) if flat.numel() else ([], [])
    buckets = sorted(set(rank_buckets))
    checked = None if nan + inf else args
    return _Float32Pass(
        weight, flat, checked, input_weights, moments, nan, inf, ranks, rank_buckets,
        below_buckets, buckets, int(upper[buckets].sum()),
    )  # fmt: skip


def _float32_second_pass(
    first: _Float32Pass, int_grid: tuple[float, float, float, float] | None
) -> TensorStats:
    at_rank, tail, int_error = _refine_buckets(first, _tail_bounds(first.moments), int_grid)
    q1, q3 = (_quantile(first.moments.count, q, at_rank.__getitem__) for q in (0.25, 0.75))
    per_tensor = None if int_grid is None else lambda: int_error
    errors = _quantization_errors(
        first.weight, first.moments, first.args, first.input_weights, per_tensor
    )
    return _finish(first.weight.numel(), first.moments, first.nan, first.inf, q1, q3, tail, errors)


@dataclass(frozen=True, slots=True)
class _Float32Summary:
    """The first pass over float32 values: their moments (min and max mean nothing, and the sum
    of squares is not finite, when a value is not finite), the histogram of their upper 16
    bits, and whether every value is a bfloat16 (no lower 16 bits set)."""

    moments: _Moments
    upper: numpy.ndarray
    bfloat16_valued: bool


def _float32_summary(flat: Tensor) -> _Float32Summary:
    upper = numpy.zeros(1 << _BITS, dtype=numpy.int64)
    low, high, total, squares, lower_halves_used = passes.float32_summary(flat.numpy(), upper)
    if not flat.numel():
        low = high = 0.0
    moments = _Moments(flat.numel(), low, high, total, squares)
    return _Float32Summary(moments, upper, bfloat16_valued=not lower_halves_used)


def _int_grids(
    firsts: list[_Float32Pass], args: QuantArgs | None
) -> list[tuple[float, float, float, float] | None]:
    """For each tensor whose second pass computes the per-tensor integer error: (scale, zero
    point, lowest code, highest code), chosen by `quantize`'s own `choose_qparams` (the scale
    rounded to float32) in one call for all of them; None for the others."""
    wanted = [first for first in firsts if first.per_tensor_int]
    if args is None or not wanted:
        return [None] * len(firsts)
    scales, zeros = _tensor_qparams([first.moments for first in wanted], args, torch.float32)
    zero_points = [0.0] * len(wanted) if zeros is None else zeros.tolist()
    lowest, highest = map(float, int_range(args.num_bits))
    grids = iter(zip(scales.tolist(), zero_points, strict=True))
    return [(*next(grids), lowest, highest) if first.per_tensor_int else None for first in firsts]


def _quantile_ranks(count: int) -> list[int]:
    """The 0-based ranks that the quartiles interpolate between."""
    ranks = set()
    for q in (0.25, 0.75):
        position = q * max(count - 1, 0)
        ranks.update({math.floor(position), min(math.ceil(position), max(count - 1, 0))})
    return sorted(ranks)


def _refine_buckets(
    first: _Float32Pass,
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


# --- shared -------------------------------------------------------------------------------


def _tensor_qparams(
    moments: Sequence[_Moments], args: QuantArgs, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """Per-tensor scales and zero points (one each) of tensors of `dtype` with these `moments`,
    by `quantize`'s own `choose_qparams`, in one call."""
    return choose_qparams(
        torch.tensor([m.min for m in moments]), torch.tensor([m.max for m in moments]), args,
        scale_dtype=scale_dtype_for(dtype),
    )  # fmt: skip


def _view11(zero: Tensor | None) -> Tensor | None:
    return None if zero is None else zero.view(1, 1)


def scale_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Scales are stored in the weight's dtype, as `quantize` writes them; float32 for FP8."""
    return dtype if dtype.itemsize >= 2 else ACCUM_DTYPE


_Errors = tuple[float | None, float | None, float | None]  # squared, weighted NRMSE, output


def _quantization_errors(
    weight: Tensor,
    moments: _Moments,
    args: QuantArgs | None,
    input_weights: Tensor | None,
    per_tensor_error: Callable[[], float] | None = None,
) -> _Errors:
    """(squared quantization error, weighted NRMSE, output error). A per-tensor error comes from
    the value histogram when it can (`per_tensor_error`); a 1-D tensor has no rows to scale per
    channel."""
    if args is None or (weight.ndim < 2 and args.strategy != "tensor"):
        return None, None, None
    if input_weights is None and args.strategy == "tensor" and per_tensor_error is not None:
        return per_tensor_error(), None, None
    return _blocked_errors(weight, moments, args, input_weights)


def _blocked_errors(
    weight: Tensor, moments: _Moments, args: QuantArgs, input_weights: Tensor | None
) -> _Errors:
    """Quantize-dequantize in blocks of whole rows (rows: every dim but the last) with the same
    primitives as `quantize`: the squared error and, given input weights, the weighted NRMSE and
    the output error."""
    rows = weight.reshape(-1, weight.shape[-1]) if weight.ndim >= 2 else weight.reshape(1, -1)
    scale_dtype = scale_dtype_for(weight.dtype)
    if args.strategy == "tensor":
        scale, zero = _tensor_qparams([moments], args, weight.dtype)
    else:
        args = fit_group_size(args, rows.shape[1])
    total, column_error, column_norm = 0.0, 0.0, 0.0
    step = max(1, CHUNK_ELEMENTS // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        block = rows[start : start + step].to(ACCUM_DTYPE)  # FP8 has no min/max; exact in fp32
        if args.strategy == "tensor":
            codes = quantize_grouped(block.view(1, 1, -1), scale.view(1, 1), _view11(zero), args)
            restored = scale_codes(codes, scale, zero).view(block.shape)
        else:
            restored = quantize_weight(block, args, scale_dtype=scale_dtype).dequantize()
        error = (block - restored).to(torch.float64)
        total += float(torch.dot(error.view(-1), error.view(-1)))
        if input_weights is not None:
            column_error = column_error + error.square().sum(0)
            column_norm = column_norm + block.to(torch.float64).square().sum(0)
    if input_weights is None:
        return total, None, None
    weights = input_weights.to(torch.float64)
    output = float((column_error * weights).sum())  # type: ignore[operator]
    reference = float((column_norm * weights).sum())  # type: ignore[operator]
    return total, math.sqrt(output / reference) if reference else 0.0, output


def _finish(
    numel: int,
    moments: _Moments,
    nan: int,
    inf: int,
    q1: float,
    q3: float,
    tail: int,
    errors: _Errors,
) -> TensorStats:
    squared_error, weighted_nrmse, output_error = errors
    nrmse = range_nrmse = None
    if squared_error is not None and moments.count:
        nrmse = math.sqrt(squared_error / moments.squares) if moments.squares else 0.0
        spread = moments.max - moments.min
        rmse = math.sqrt(squared_error / moments.count)
        range_nrmse = rmse / spread if spread else 0.0
    return TensorStats(
        numel=numel,
        nan=nan,
        inf=inf,
        min=moments.min,
        max=moments.max,
        absmax=max(abs(moments.min), abs(moments.max)),
        mean=moments.mean,
        std=moments.std,
        q1=q1,
        q3=q3,
        tail_share=tail / moments.count if moments.count else 0.0,
        nrmse=nrmse,
        range_nrmse=range_nrmse,
        weighted_nrmse=weighted_nrmse,
        output_error=output_error,
    )
