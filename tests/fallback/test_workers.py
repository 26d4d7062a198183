"""The thread pool: the same findings with one worker or two, and sampled rows."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmq


def test_workers_and_sampling(checkpoint: Path) -> None:
    one = llmq.fallback_scan(checkpoint, workers=1)
    two = llmq.fallback_scan(checkpoint, workers=2)
    for a, b in zip(one.tensors, two.tensors, strict=True):
        assert (a.name, a.reasons) == (b.name, b.reasons)
        x, y = a.stats, b.stats
        assert (x.q1, x.q3, x.min, x.max) == (y.q1, y.q3, y.min, y.max)
        # float32 sums split over a different number of threads: equal to rounding
        assert x.nrmse == pytest.approx(y.nrmse, rel=1e-6) and x.std == pytest.approx(y.std, rel=1e-6)  # fmt: skip
    sampled = llmq.fallback_scan(checkpoint, sample=1000)
    big = next(t for t in sampled.tensors if t.name.endswith("down_proj.weight"))
    assert big.sampled and big.stats.numel == 8 * 128  # whole rows, about 1000 values
