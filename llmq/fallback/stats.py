"""Exact statistics of one weight tensor, streamed in chunks: no sort, no sampling, no upcast copy.

Quartiles come from histograms of bit patterns. A 16-bit (or 8-bit) float has at most 65,536
distinct values, so one `bincount` over its bit patterns is the whole distribution: every order
statistic, the mean, the standard deviation and the tail counts follow from the 65,536 counts, and
so does the per-tensor quantization error (the error of a value depends on the value alone).
A float32 is split in two: a histogram of its upper 16 bits finds the bucket that holds a wanted
rank, and a second pass histograms the lower 16 bits of that bucket alone.

Quantiles interpolate linearly between the two nearest order statistics, as `torch.quantile`
does. std is the population standard deviation (divided by n).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import numpy
import torch
from torch import Tensor

from llmq.config import QuantArgs, fit_group_size
from llmq.quant.primitives import (
    ACCUM_DTYPE,
    choose_qparams,
    quantize_grouped,
    quantize_weight,
    scale_codes,
    to_code_grid_,
)

CHUNK_ELEMENTS = 1 << 20
"""Elements processed at once: a few MB of working memory, whatever the tensor's size."""
TAIL_SIGMAS = 6.0
_BITS = 16  # bucket width of the histograms
_LOWER = 0 if sys.byteorder == "little" else 1  # which int16 of a float32 holds its low bits

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
    if weight.dtype not in _PATTERN_DTYPES:
        raise ValueError(f"unsupported dtype {weight.dtype}")
    if input_weights is not None and (weight.ndim < 2 or input_weights.numel() != weight.shape[-1]):
        input_weights = None  # not this tensor's inputs (a 1-D tensor, another width)
    flat = weight.reshape(-1)
    if weight.element_size() <= 2:
        return _small_float_stats(weight, flat, args, input_weights)
    return _float32_stats(weight, flat, args, input_weights)


def _flat_chunks(flat: Tensor) -> Iterator[Tensor]:
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        yield flat[start : start + CHUNK_ELEMENTS]


# --- 8- and 16-bit floats: one histogram is the whole distribution ---------------------------


@cache
def _pattern_table(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Every bit pattern's value (float64) and its place in ascending order of value."""
    bits = torch.finfo(dtype).bits
    patterns = torch.arange(1 << bits, dtype=torch.int64)
    as_signed = torch.where(patterns >= 1 << (bits - 1), patterns - (1 << bits), patterns)
    values = as_signed.to(_PATTERN_DTYPES[dtype]).view(dtype).to(torch.float64)
    position = torch.empty_like(patterns)
    position[torch.argsort(_order_keys(patterns, bits))] = patterns
    return values, position


def _order_keys(patterns: Tensor, bits: int) -> Tensor:
    """Unsigned keys that sort sign-magnitude float patterns by value (-0 just below +0)."""
    sign = 1 << (bits - 1)
    return torch.where(patterns >= sign, (1 << bits) - 1 - patterns, patterns + sign)


class _Ranked:
    """Occupied bit patterns ranked by value: which pattern holds a given rank, and how many
    values lie below a pattern. A weight occupies a few thousand of the 65,536 patterns: one
    pass finds them, and every lookup after that touches only those."""

    def __init__(self, patterns: Tensor, counts: Tensor, position: Tensor) -> None:
        self._positions, by_value = torch.sort(position[patterns])
        self._patterns = patterns[by_value]
        self._position = position
        self._cumulative = counts[by_value].cumsum(0)

    def pattern_at(self, rank: int) -> int:
        """The pattern of the value at 0-based `rank`."""
        return int(self._patterns[torch.searchsorted(self._cumulative, rank, right=True)])

    def count_below(self, pattern: int) -> int:
        """Values whose pattern sorts below `pattern` (occupied or not)."""
        occupied_below = int(torch.searchsorted(self._positions, self._position[pattern]))
        return int(self._cumulative[occupied_below - 1]) if occupied_below else 0


def _pattern_histogram(chunks: Iterator[Tensor], bits: int) -> Tensor:
    """Counts of the `bits`-bit unsigned patterns over all chunks."""
    counts = torch.zeros(1 << bits, dtype=torch.int64)
    for chunk in chunks:
        patterns = chunk if chunk.dtype == torch.uint8 else _unsigned(chunk)
        counts += torch.bincount(patterns, minlength=1 << bits)
    return counts


def _small_float_stats(
    weight: Tensor, flat: Tensor, args: QuantArgs | None, input_weights: Tensor | None
) -> TensorStats:
    bits = torch.finfo(weight.dtype).bits
    patterns = (c.view(_PATTERN_DTYPES[weight.dtype]) for c in _flat_chunks(flat))
    counts = _pattern_histogram(patterns, bits)
    return _histogram_stats(weight, counts, weight.dtype, args, input_weights)


def _histogram_stats(
    weight: Tensor,
    counts: Tensor,
    table: torch.dtype,
    args: QuantArgs | None,
    input_weights: Tensor | None,
) -> TensorStats:
    """Everything from the counts of each bit pattern of `table`, a dtype holding every value
    of `weight` exactly; only per-channel and per-group errors read the data again."""
    values, position = _pattern_table(table)
    occupied = counts.nonzero().view(-1)  # the only pass over all patterns
    occupied_values, occupied_counts = values[occupied], counts[occupied]
    nan = int(occupied_counts[occupied_values.isnan()].sum())
    inf = int(occupied_counts[occupied_values.isinf()].sum())
    finite = occupied_values.isfinite()
    present, multiplicity = occupied_values[finite], occupied_counts[finite].to(torch.float64)
    moments = _Moments(
        count=int(multiplicity.sum()),
        min=float(present.min()) if present.numel() else 0.0,
        max=float(present.max()) if present.numel() else 0.0,
        total=float((present * multiplicity).sum()),
        squares=float((present.square() * multiplicity).sum()),
    )
    ranked = _Ranked(occupied[finite], occupied_counts[finite], position)
    q1, q3 = (
        _quantile(moments.count, q, lambda k: float(values[ranked.pattern_at(k)]))
        for q in (0.25, 0.75)
    )
    low, high = _tail_bounds(moments)
    tail = int(multiplicity[(present < low) | (present > high)].sum())
    errors = _quantization_errors(
        weight, moments, None if nan + inf else args, input_weights,
        lambda: _value_error(present, multiplicity, moments, args, weight.dtype),
    )  # fmt: skip
    return _finish(weight.numel(), moments, nan, inf, q1, q3, tail, errors)


def _value_error(
    values: Tensor, counts: Tensor, moments: _Moments, args: QuantArgs, dtype: torch.dtype
) -> float:
    """Per-tensor quantization error from the distinct values: each value's error times its
    count. The codes come from the same primitives as `quantize`."""
    scale, zero = _tensor_qparams(moments, args, dtype)
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


def _float32_stats(
    weight: Tensor, flat: Tensor, args: QuantArgs | None, input_weights: Tensor | None
) -> TensorStats:
    moments, upper, lower_halves_used = _float32_summary(flat)
    if not lower_halves_used:  # every value is a bfloat16 (a bf16 checkpoint saved as fp32)
        return _histogram_stats(weight, upper, torch.bfloat16, args, input_weights)
    nan = inf = 0
    if not (math.isfinite(moments.min) and math.isfinite(moments.max)):
        nan, inf = int(flat.isnan().sum()), int(flat.isinf().sum())
        flat = flat[flat.isfinite()]  # a copy, in this rare case only
        moments, upper, _ = _float32_summary(flat)
    ranks = _quantile_ranks(moments.count)
    low, high = _tail_bounds(moments)
    at_rank, tail = _refine_buckets(flat, upper, ranks, low, high)
    q1, q3 = (_quantile(moments.count, q, lambda k: at_rank[k]) for q in (0.25, 0.75))
    checked = None if nan + inf else args
    per_tensor = None
    if checked is not None and checked.type == "int":
        per_tensor = functools.partial(_int_tensor_error, flat, moments, checked)
    errors = _quantization_errors(weight, moments, checked, input_weights, per_tensor)
    return _finish(weight.numel(), moments, nan, inf, q1, q3, tail, errors)


def _float32_summary(flat: Tensor) -> tuple[_Moments, Tensor, bool]:
    """One pass: min, max, sum and sum of squares, the histogram of the upper 16 bits, and
    whether any lower 16 bits are set (checked until one is: the first chunk, for genuine
    float32 weights). Sums are torch's cascaded float32 sums of each chunk (relative error
    ~1e-7 on a million values, where a float32 dot product is off by ~1e-5), added in float64:
    a float64 copy of every chunk cost a fifth of the scan. min and max are NaN when some
    value is."""
    low, high, total, squares = math.inf, -math.inf, 0.0, 0.0
    upper = torch.zeros(1 << _BITS, dtype=torch.int64)
    lower_halves_used = False
    for chunk in _flat_chunks(flat):
        lower_halves_used = lower_halves_used or _any_lower_half(chunk)
        chunk_low, chunk_high = (float(v) for v in torch.aminmax(chunk))
        low = math.nan if math.isnan(chunk_low) else min(low, chunk_low)
        high = math.nan if math.isnan(chunk_high) else max(high, chunk_high)
        total += float(chunk.sum())
        squares += float(chunk.square().sum())
        upper += torch.bincount(_upper_halves(chunk), minlength=1 << _BITS)
    if not flat.numel():
        low = high = 0.0
    return _Moments(flat.numel(), low, high, total, squares), upper, lower_halves_used


def _int_tensor_error(flat: Tensor, moments: _Moments, args: QuantArgs) -> float:
    """Squared error of per-tensor integer quantization, chunk by chunk in float32, with the
    scale and zero point of `quantize`, its rounding rule (`to_code_grid_`) and dequantization
    (`scale_codes`). Only the division is float32 where `quantize` divides in float64: a code
    can differ only for a value within a float32 rounding of a rounding boundary, whose error
    is half a step either way. Twice as fast as float64 working copies. (Feeding this from
    the bucket pass, while each chunk is in the cache, measured slower than its own pass.)"""
    scale, zero = _tensor_qparams(moments, args, torch.float32)
    total = 0.0
    for chunk in _flat_chunks(flat):
        codes = to_code_grid_(chunk / scale, zero, args)
        total += float(scale_codes(codes, scale, zero).sub_(chunk).square_().sum())
    return total


def _any_lower_half(chunk: Tensor) -> bool:
    """Whether any value has lower 16 bits set; the first 4,096 values answer for genuine
    float32 weights."""
    lower_half = _halves(chunk)[0]
    return bool(torch.count_nonzero(lower_half[:4096])) or bool(torch.count_nonzero(lower_half))


def _upper_halves(chunk: Tensor) -> Tensor:
    """The upper 16 bits of float32 values as unsigned int32 (what bincount counts), from one
    contiguous shift in numpy: 3.5x faster than converting torch's strided int16 view."""
    bits = chunk.numpy().view(numpy.uint32) >> numpy.uint32(_BITS)
    return torch.from_numpy(bits.view(numpy.int32))


def _halves(chunk: Tensor) -> tuple[Tensor, Tensor]:
    """Views of the lower and upper 16 bits of float32 values (the upper half is the value
    truncated to bfloat16)."""
    halves = chunk.view(torch.int16).view(-1, 2)
    return halves[:, _LOWER], halves[:, 1 - _LOWER]


def _unsigned(half: Tensor) -> Tensor:
    """int16 bit patterns as their unsigned values, int32 (what bincount counts)."""
    return half.view(torch.uint16).to(torch.int32)


def _signed16(pattern: int) -> int:
    return pattern - (1 << _BITS) if pattern >= 1 << (_BITS - 1) else pattern


def _quantile_ranks(count: int) -> list[int]:
    """The 0-based ranks that the quartiles interpolate between."""
    ranks = set()
    for q in (0.25, 0.75):
        position = q * max(count - 1, 0)
        ranks.update({math.floor(position), min(math.ceil(position), max(count - 1, 0))})
    return sorted(ranks)


def _refine_buckets(
    flat: Tensor, upper: Tensor, ranks: list[int], low: float, high: float
) -> tuple[dict[int, float], int]:
    """Values at `ranks` and the count outside [low, high], from one pass that keeps only the
    members of the few upper-half buckets those depend on."""
    if not flat.numel():
        return dict.fromkeys(ranks, 0.0), 0
    occupied = upper.nonzero().view(-1)
    # a float32's upper half is a bfloat16: bfloat16's pattern order is the buckets' order
    ranked = _Ranked(occupied, upper[occupied], _pattern_table(torch.bfloat16)[1])
    rank_buckets = {k: ranked.pattern_at(k) for k in ranks}
    low_bucket, high_bucket = (_bucket_of(bound) for bound in (low, high))
    # a threshold's bucket is only read when it holds values (in the far tails it rarely does)
    tail_buckets = [b for b in (low_bucket, high_bucket) if upper[b] > 0]
    wanted = sorted({*rank_buckets.values(), *tail_buckets})
    found = [_members(chunk, wanted) for chunk in _flat_chunks(flat)]
    members = torch.cat([values for values, _ in found])
    member_keys = torch.cat([keys for _, keys in found])

    def in_bucket(bucket: int) -> Tensor:
        return members[member_keys == _signed16(bucket)]

    at_rank = {}
    for k, bucket in rank_buckets.items():
        wanted_rank = k - ranked.count_below(bucket) + 1
        at_rank[k] = float(torch.kthvalue(in_bucket(bucket), wanted_rank).values)
    below = ranked.count_below(low_bucket) + int((in_bucket(low_bucket) < low).sum())
    above = (
        flat.numel() - ranked.count_below(high_bucket) - int(upper[high_bucket])
        + int((in_bucket(high_bucket) > high).sum())
    )  # fmt: skip
    return at_rank, below + above


def _members(chunk: Tensor, buckets: list[int]) -> tuple[Tensor, Tensor]:
    """The values whose upper half is one of `buckets` (a handful: comparisons beat a lookup
    table), and their upper halves as signed keys (`_signed16` of the bucket). In numpy, whose
    comparisons and boolean selection are about 5x faster than torch's on a million values
    (this pass was a fifth of a float32 scan)."""
    values = chunk.numpy()
    upper_half = values.view(numpy.int32) >> _BITS  # signed, contiguous: compares fastest
    selected = upper_half == _signed16(buckets[0])
    for bucket in buckets[1:]:
        selected |= upper_half == _signed16(bucket)
    members = values[selected]  # few: their keys are recomputed rather than selected too
    return torch.from_numpy(members), torch.from_numpy(members.view(numpy.int32) >> _BITS)


def _bucket_of(value: float) -> int:
    return int(_unsigned(_halves(torch.tensor([value], dtype=torch.float32))[1]))


# --- shared -------------------------------------------------------------------------------


def _tensor_qparams(
    moments: _Moments, args: QuantArgs, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    scale, zero = choose_qparams(
        torch.tensor([moments.min]), torch.tensor([moments.max]), args,
        scale_dtype=scale_dtype_for(dtype),
    )  # fmt: skip
    return scale, zero


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
        scale, zero = _tensor_qparams(moments, args, weight.dtype)
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
