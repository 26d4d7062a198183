"""Quartiles from counts, with no sort: which order statistics the quartiles need
(`quantile_ranks`), which bit pattern of a histogram holds each (`at_ranks`), and the linear
interpolation between the two nearest order statistics that `torch.quantile` does (`quantile`).

Shared by both ways of reading a tensor: `llmq.fallback.histogram` finds the quartiles' values
directly in its histogram, `llmq.fallback.float32` finds the upper-16-bit buckets that hold
them and then the values within those buckets.
"""

from __future__ import annotations

import math

import numpy

from llmq.fallback import passes


def quantile_ranks(count: int) -> list[int]:
    """The 0-based ranks that the quartiles interpolate between."""
    ranks = set()
    for q in (0.25, 0.75):
        position = q * max(count - 1, 0)
        ranks.update({math.floor(position), min(math.ceil(position), max(count - 1, 0))})
    return sorted(ranks)


def at_ranks(counts: numpy.ndarray, ranks: list[int]) -> tuple[list[int], list[int]]:
    """For each 0-based rank: the pattern holding the value at that rank, and how many
    values lie in the patterns below it (`counts` of sign-magnitude float patterns)."""
    patterns, below = passes.patterns_at_ranks(counts, numpy.asarray(ranks))
    return patterns.tolist(), below.tolist()


def quantile(count: int, q: float, value_at_rank: object) -> float:
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
