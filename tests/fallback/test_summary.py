"""What a tensor's statistics report at the edges: constant tensors and the spread ratio."""

from __future__ import annotations

import math

import torch

from llmq.fallback.stats import tensor_stats
from llmq.fallback.summary import spread_ratio
from tests.fallback.conftest import INT8_CHANNEL, INT8_TENSOR, heavy_tailed


def test_all_zero_and_constant_tensors() -> None:
    zeros = tensor_stats(torch.zeros(8, 64, dtype=torch.bfloat16), INT8_TENSOR)
    assert (zeros.nrmse, zeros.std, zeros.q1, zeros.q3) == (0.0, 0.0, 0.0, 0.0)
    assert zeros.spread_ratio == 0.0
    ones = tensor_stats(torch.ones(4, 32), INT8_CHANNEL)
    assert ones.nrmse == 0.0 and ones.absmax == 1.0


def test_spread_ratio_flags_an_outlier() -> None:
    gaussian = tensor_stats(heavy_tailed(256, 256, torch.bfloat16)[8:], None)
    outlier = tensor_stats(heavy_tailed(256, 256, torch.bfloat16), None)
    assert gaussian.spread_ratio < 12 and outlier.spread_ratio > 60
    assert spread_ratio(-1.0, 1.0, 0.0, 0.0) == math.inf
