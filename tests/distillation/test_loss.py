"""The distillation losses, the learning-rate schedule and the data order, against float64
references and their definitions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from llmq.config import DistillConfig
from llmq.distillation.data import BatchOrder
from llmq.distillation.loss import hidden_cosine, kl_divergence, layer_pairs, next_token_ce
from llmq.distillation.schedule import learning_rate


def kl_reference(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float) -> float:
    """KL(p || q) per token, averaged, in float64, from the definition."""
    p = torch.softmax(p_logits.double() / temperature, -1)
    q = torch.softmax(q_logits.double() / temperature, -1)
    return float((p * (p.log() - q.log())).sum(-1).mean()) * temperature**2


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kl_directions_match_the_definition(temperature: float) -> None:
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 50) * 3, torch.randn(2, 5, 50) * 3
    forward = kl_divergence(student, teacher, temperature=temperature)
    reverse = kl_divergence(student, teacher, temperature=temperature, reverse=True)
    assert forward.item() == pytest.approx(kl_reference(teacher, student, temperature), rel=1e-5)
    assert reverse.item() == pytest.approx(kl_reference(student, teacher, temperature), rel=1e-5)
    assert forward.item() != pytest.approx(reverse.item(), rel=1e-3)  # KL is not symmetric


def test_kl_of_a_distribution_with_itself_is_zero_and_its_gradient_too() -> None:
    logits = torch.randn(3, 4, 20, requires_grad=True)
    loss = kl_divergence(logits, logits.detach() + 7.0)  # a shift leaves the softmax alone
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert logits.grad is not None and logits.grad.abs().max() < 1e-6


def test_next_token_ce_scores_token_i_plus_1_from_position_i() -> None:
    torch.manual_seed(1)
    logits, ids = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    log_p = torch.log_softmax(logits.double(), -1)
    expected = -sum(log_p[b, i, ids[b, i + 1]] for b in range(2) for i in range(5)) / 10
    assert next_token_ce(logits, ids).item() == pytest.approx(float(expected), rel=1e-6)


def test_hidden_cosine_is_zero_for_parallel_states_and_one_for_orthogonal() -> None:
    h = torch.randn(2, 3, 8)
    assert hidden_cosine([h], [2.5 * h]).item() == pytest.approx(0.0, abs=1e-6)
    a, b = torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)
    a[..., 0], b[..., 1] = 1.0, 1.0
    assert hidden_cosine([a], [b]).item() == pytest.approx(1.0)


def test_layer_pairs_follow_kept_layers_or_spread_evenly() -> None:
    assert layer_pairs(3, 5, [0, 2, 4]) == [(0, 0), (1, 2), (2, 4)]
    assert layer_pairs(2, 4, None) == [(0, 1), (1, 3)]
    assert layer_pairs(4, 4, None) == [(i, i) for i in range(4)]


def test_learning_rate_warms_up_linearly_then_follows_the_cosine() -> None:
    config = DistillConfig(max_steps=12, lr=1e-3, warmup_steps=2, min_lr_ratio=0.1)
    rates = [learning_rate(s, config) for s in range(12)]
    assert rates[:2] == pytest.approx([5e-4, 1e-3])
    assert rates[2] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-4)
    expected = 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (6 - 2) / 9))
    assert rates[6] == pytest.approx(expected)
    assert all(a > b for a, b in itertools.pairwise(rates[2:]))  # falls after the warm-up


def test_batch_order_is_a_pure_function_of_the_step_and_covers_each_epoch() -> None:
    windows = torch.arange(10).unsqueeze(1).repeat(1, 4)
    order = BatchOrder(windows, global_batch=4, seed=3)
    assert order.indices(2) == BatchOrder(windows, 4, 3).indices(2)  # no hidden state
    first_epoch = order.indices(0) + order.indices(1) + order.indices(2)[:2]
    assert sorted(first_epoch) == list(range(10))  # every window once per epoch
    assert order.indices(2)[2:] == order._permutation(1)[:2]  # the next epoch goes on
    assert order._permutation(1) != order._permutation(0)
    halves = torch.cat([order.batch(5, rank=0, world_size=2), order.batch(5, rank=1, world_size=2)])
    assert torch.equal(halves, order.batch(5))
