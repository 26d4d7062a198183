"""8- and 16-bit floats: one histogram of bit patterns is the whole distribution.

A 16-bit (or 8-bit) float has at most 65,536 distinct values, so one `bincount` over its bit
patterns (compiled: `llmq.fallback.passes`) gives every order statistic, the mean, the standard
deviation and the tail counts, and so does the per-tensor quantization error (the error of a
value depends on the value alone). A float32 tensor that holds bfloat16 values (a bf16
checkpoint saved as fp32) takes this path too, from the histogram of its upper halves.
"""

from __future__ import annotations

from functools import cache

import numpy
import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.fallback import passes
from llmq.fallback.quant_error import quantization_errors, value_error
from llmq.fallback.quartiles import at_ranks, quantile, quantile_ranks
from llmq.fallback.summary import Moments, TensorStats, finish_stats, tail_bounds

PATTERN_DTYPES = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}
"""The dtypes whose values the scan reads, and the integer dtype of their bit patterns."""


@cache
def _pattern_values(dtype: torch.dtype) -> numpy.ndarray:
    """Every bit pattern's value (float64)."""
    bits = torch.finfo(dtype).bits
    patterns = torch.arange(1 << bits, dtype=torch.int64)
    as_signed = torch.where(patterns >= 1 << (bits - 1), patterns - (1 << bits), patterns)
    return as_signed.to(PATTERN_DTYPES[dtype]).view(dtype).to(torch.float64).numpy()


def _pattern_histogram(weight: Tensor) -> numpy.ndarray:
    """Counts of each unsigned bit pattern of an 8- or 16-bit float tensor."""
    bits = torch.finfo(weight.dtype).bits
    patterns = weight.reshape(-1).view(PATTERN_DTYPES[weight.dtype]).numpy()
    counts = numpy.zeros(1 << bits, dtype=numpy.int64)
    passes.pattern_histogram(patterns.view(numpy.uint16 if bits == 16 else numpy.uint8), counts)
    return counts


def small_float_stats(
    weight: Tensor, args: QuantArgs | None, input_weights: Tensor | None
) -> TensorStats:
    counts = _pattern_histogram(weight)
    return histogram_stats(weight, counts, weight.dtype, args, input_weights)


def histogram_stats(
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
    moments = Moments(
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
    ranks = quantile_ranks(moments.count)
    patterns, _ = at_ranks(finite_counts, ranks)
    at_rank = {k: float(values[pattern]) for k, pattern in zip(ranks, patterns, strict=True)}
    q1, q3 = (quantile(moments.count, q, at_rank.__getitem__) for q in (0.25, 0.75))
    low, high = tail_bounds(moments)
    tail = int(multiplicity[(present < low) | (present > high)].sum())
    errors = quantization_errors(
        weight, moments, None if nan + inf else args, input_weights,
        lambda: value_error(
            torch.from_numpy(present), torch.from_numpy(multiplicity), moments, args, weight.dtype
        ),
    )  # fmt: skip
    return finish_stats(weight.numel(), moments, nan, inf, q1, q3, tail, errors)
