"""What the scan reports for one tensor (`TensorStats`), and the exact moments it is built from.

Every way of reading a tensor (`llmq.fallback.histogram` for 8- and 16-bit floats,
`llmq.fallback.float32` for float32) ends the same way: the count, min, max, sum and sum of
squares of its finite values (`Moments`), its quartiles, how many values lie beyond TAIL_SIGMAS
standard deviations of the mean (`tail_bounds`) and its quantization errors go through
`finish_stats` into one `TensorStats`. Plain Python, no torch: the report reads these back.

std is the population standard deviation (divided by n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TAIL_SIGMAS = 6.0


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
    weighted_nrmse: float | None = None  # with input weights: see stats.tensor_stats
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
class Moments:
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


def tail_bounds(moments: Moments) -> tuple[float, float]:
    spread = TAIL_SIGMAS * moments.std
    return moments.mean - spread, moments.mean + spread


QuantErrors = tuple[float | None, float | None, float | None]  # squared, weighted NRMSE, output


def finish_stats(
    numel: int,
    moments: Moments,
    nan: int,
    inf: int,
    q1: float,
    q3: float,
    tail: int,
    errors: QuantErrors,
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
