"""Paired gates on hand-made per-item scores whose statistics are worked out by hand."""

from __future__ import annotations

import math

import pytest

from llmq.eval.gates import judge, paired_difference

Z95_ONE_SIDED = 1.6448536269514722
Z95_TWO_SIDED = 1.959963984540054


def test_a_real_drop_fails_a_tight_gate_and_passes_a_loose_one() -> None:
    """100 items the baseline gets right; the candidate loses 10 of them. d = -1 on 10 items,
    0 on 90: mean -0.1, sample sd sqrt(9 / 99), standard error sqrt(9 / 99) / 10."""
    baseline, candidate = [1.0] * 100, [0.0] * 10 + [1.0] * 90
    pair = paired_difference(candidate, baseline)
    se = math.sqrt(9 / 99) / 10
    assert pair.difference == pytest.approx(-0.1, abs=1e-15)
    assert pair.upper_bound == pytest.approx(-0.1 + Z95_ONE_SIDED * se, rel=1e-12)
    assert (pair.ci_low, pair.ci_high) == pytest.approx((-0.1 - Z95_TWO_SIDED * se, -0.1 + Z95_TWO_SIDED * se), rel=1e-12)  # fmt: skip
    assert pair.significant_drop
    assert not judge(pair, "max_drop", 0.05).passed
    assert judge(pair, "max_drop", 0.15).passed  # significant, but within the threshold
    assert not judge(pair, "min_recovery", 0.95).passed  # 0.90 of the baseline
    assert judge(pair, "min_recovery", 0.9).passed


def test_a_drop_that_could_be_noise_passes_even_past_the_threshold() -> None:
    """10 items, 2 lost: mean -0.2 but standard error sqrt(1.6 / 9) / sqrt(10) = 0.133, so the
    one-sided bound -0.2 + 1.645 * 0.133 = +0.019 is above zero: not significant."""
    pair = paired_difference([0.0, 0.0] + [1.0] * 8, [1.0] * 10)
    assert pair.upper_bound == pytest.approx(-0.2 + Z95_ONE_SIDED * math.sqrt(1.6 / 9 / 10), rel=1e-12)  # fmt: skip
    verdict = judge(pair, "max_drop", 0.01)
    assert verdict.beyond and not verdict.significant and verdict.passed
    assert not judge(paired_difference([0.0, 0.0] + [1.0] * 8, [1.0] * 10, confidence=0.5), "max_drop", 0.01).passed  # fmt: skip


def test_the_same_answers_pass_with_no_spread() -> None:
    scores = [1.0, 0.0, 1.0, 1.0]
    pair = paired_difference(scores, scores)
    assert (pair.difference, pair.ci_low, pair.ci_high) == (0.0, 0.0, 0.0)
    assert judge(pair, "max_drop", 0.0).passed and judge(pair, "min_recovery", 1.0).passed


def test_unpaired_scores_are_refused() -> None:
    with pytest.raises(ValueError, match="same items"):
        paired_difference([1.0], [1.0, 0.0])
