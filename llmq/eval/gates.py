"""Accuracy gates that do not flake: paired per-item differences against the baseline.

Baseline and candidate answer the same items, so the gate looks at d_i = candidate_i -
baseline_i: its mean, and its standard error sd(d) / sqrt(n), which is much smaller than the
two scores' own errors whenever the models agree on most items. A gate fails only when the
drop is significant (the one-sided upper bound of the mean difference at `confidence` is below
zero) *and* beyond its threshold: `max_drop` (absolute, baseline - candidate) or `min_recovery`
(candidate / baseline, the peers' convention). Pure float64 arithmetic, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist, fmean, stdev
from typing import Literal

from llmq.config import DEFAULT_CONFIDENCE

GateKind = Literal["max_drop", "min_recovery"]


@dataclass(frozen=True, slots=True)
class PairedDifference:
    score: float  # candidate's mean
    baseline: float  # baseline's mean
    difference: float  # mean of candidate - baseline
    ci_low: float  # two-sided interval of the difference at `confidence`
    ci_high: float
    upper_bound: float  # one-sided upper bound of the difference at `confidence`
    items: int
    confidence: float

    @property
    def significant_drop(self) -> bool:
        return self.upper_bound < 0.0


def paired_difference(
    candidate: Sequence[float], baseline: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE
) -> PairedDifference:
    if len(candidate) != len(baseline) or not candidate:
        raise ValueError(f"paired scores need the same items: {len(candidate)} and {len(baseline)}")  # fmt: skip
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence {confidence}: in [0.5, 1)")
    diffs = [float(c) - float(b) for c, b in zip(candidate, baseline, strict=True)]
    mean = fmean(diffs)
    se = stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    two_sided = NormalDist().inv_cdf(0.5 + confidence / 2) * se
    return PairedDifference(
        score=fmean(map(float, candidate)), baseline=fmean(map(float, baseline)),
        difference=mean, ci_low=mean - two_sided, ci_high=mean + two_sided,
        upper_bound=mean + NormalDist().inv_cdf(confidence) * se,
        items=len(diffs), confidence=confidence,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class GateVerdict:
    kind: GateKind
    threshold: float
    beyond: bool  # the point estimate is past the threshold
    significant: bool  # the drop is significant at the confidence level
    passed: bool


def judge(pair: PairedDifference, kind: GateKind, threshold: float) -> GateVerdict:
    """Fail only when the drop is both significant and past the threshold."""
    if kind == "max_drop":
        beyond = -pair.difference > threshold
    else:
        beyond = pair.score < threshold * pair.baseline
    failed = beyond and pair.significant_drop
    return GateVerdict(kind, threshold, beyond, pair.significant_drop, not failed)
