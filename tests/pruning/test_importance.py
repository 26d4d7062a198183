"""Structured importance on hand-built cases where the answer is known."""

from __future__ import annotations

import pytest
import torch

from llmq.calib.stats import InputStats
from llmq.pruning.importance import (
    block_importance,
    channel_importance,
    head_importance,
    hidden_importance,
    kept_indices,
    kv_group_importance,
)


def sums_of_squares(x: torch.Tensor) -> torch.Tensor:
    """What the pipeline collects for a linear's input x [tokens, in]."""
    stats = InputStats.empty(x.shape[-1], hessian=False, device=x.device, norms=True)
    stats.update(x)
    assert stats.sq_sum is not None
    return stats.sq_sum


def test_a_head_whose_output_is_zero_is_ranked_last() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, head_dim = 4, 8
    x = torch.randn(64, heads * head_dim, generator=gen)
    x[:, 2 * head_dim : 3 * head_dim] = 0  # head 2 contributes nothing
    x[:, :head_dim] *= 3  # head 0 carries the most
    scores = head_importance(sums_of_squares(x), heads)
    assert scores.argmin() == 2 and scores[2] == 0 and scores.argmax() == 0
    expected = x.double().reshape(64, heads, head_dim).square().sum(dim=(0, 2)).sqrt()
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=0)
    assert kept_indices(scores, 3).tolist() == [0, 1, 3]


def test_kv_groups_are_their_query_heads_together() -> None:
    heads = torch.tensor([3.0, 4.0, 0.0, 1.0, 0.0, 0.0])  # 3 groups of 2 query heads
    groups = kv_group_importance(heads, 3)
    assert groups.tolist() == [5.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="do not split"):
        kv_group_importance(heads, 4)


def test_channels_rank_by_their_energy_over_tokens() -> None:
    x = torch.zeros(10, 3)
    x[0, 0] = 10.0  # large on one token
    x[:, 1] = 2.0  # moderate on every token: sqrt(40) < 10
    scores = channel_importance(sums_of_squares(x))
    assert scores.tolist() == pytest.approx([10.0, 40**0.5, 0.0])
    both = hidden_importance([sums_of_squares(x), sums_of_squares(x)])
    assert both.tolist() == pytest.approx([200**0.5, 80**0.5, 0.0])


def test_an_identity_layer_has_block_importance_zero() -> None:
    h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    assert block_importance(h, h) == pytest.approx(0.0, abs=1e-12)
    assert block_importance(h, -h) == pytest.approx(2.0)
    assert 0 < block_importance(h, h + torch.randn_like(h)) < 1


def test_kept_indices_keep_the_highest_in_order() -> None:
    assert kept_indices(torch.tensor([0.5, 2.0, 1.0, 2.0]), 2).tolist() == [1, 3]
    with pytest.raises(ValueError):
        kept_indices(torch.tensor([1.0]), 2)
