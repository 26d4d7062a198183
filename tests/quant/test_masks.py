"""Masks: N:M exact, each row's share exact, Wanda's score on a hand-computed example."""

from __future__ import annotations

import pytest
import torch

from llmq.quant.masks import Sparsity, magnitude_scores, pruned_mask, wanda_scores


def test_nm_masks_keep_the_n_largest_of_every_m() -> None:
    scores = torch.rand(32, 64, generator=torch.Generator().manual_seed(0))
    for n, m in ((2, 4), (4, 8), (1, 4)):
        mask = pruned_mask(scores, Sparsity(pattern=(n, m)))
        groups, kept = mask.reshape(32, -1, m), scores.reshape(32, -1, m)
        assert torch.all((~groups).sum(-1) == n)
        # every kept score is at least every pruned one of its group
        low_kept = torch.where(groups, torch.inf, kept).amin(-1)
        high_pruned = torch.where(groups, kept, -torch.inf).amax(-1)
        assert torch.all(low_kept >= high_pruned)


@pytest.mark.parametrize("fraction", [0.5, 0.3, 0.7, 0.01])
def test_each_row_loses_its_share_and_blocks_add_up(fraction: float) -> None:
    scores = torch.rand(8, 576, generator=torch.Generator().manual_seed(1))
    target = round(fraction * 576)
    whole = pruned_mask(scores, Sparsity(fraction=fraction))
    assert torch.all(whole.sum(1) == target)
    blocks = [pruned_mask(scores[:, s : s + 128], Sparsity(fraction=fraction), start=s) for s in range(0, 576, 128)]  # fmt: skip
    assert torch.all(torch.cat(blocks, dim=1).sum(1) == target)  # within the request, per row
    assert torch.equal(whole, scores <= scores.sort(dim=1).values[:, target - 1 : target])


def test_wanda_weighs_each_weight_by_its_input_norm() -> None:
    """Wanda's example: |w| alone would drop w[0, 1] = -0.1; weighted by ||x_j|| (x_1 is 10x
    larger than x_0) the row drops w[0, 0] = 0.5 instead."""
    weight = torch.tensor([[0.5, -0.1], [1.0, 2.0]])
    x = torch.tensor([[0.1, 1.0], [-0.1, -1.0]])  # ||x_0|| = 0.1414, ||x_1|| = 1.414
    scores = wanda_scores(weight, x.norm(dim=0))
    torch.testing.assert_close(scores, torch.tensor([[0.5 * 0.02**0.5, 0.1 * 2**0.5], [1.0 * 0.02**0.5, 2.0 * 2**0.5]]))  # fmt: skip
    half = Sparsity(fraction=0.5)
    assert pruned_mask(magnitude_scores(weight), half).tolist() == [[False, True], [True, False]]
    assert pruned_mask(scores, half).tolist() == [[True, False], [True, False]]


@pytest.mark.parametrize(
    "kwargs", [{}, {"fraction": 0.5, "pattern": (2, 4)}, {"fraction": 1.2}, {"fraction": 0.0}, {"pattern": (3, 2)}]
)  # fmt: skip
def test_bad_targets_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Sparsity(**kwargs)
