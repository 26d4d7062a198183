"""The budget solver against brute force: the same least damage on small problems, never over
the budget, refused when nothing fits; coarse steps on large budgets still never overspend."""

from __future__ import annotations

import itertools
import random

import pytest

from llmq.mixed.solve import OverBudget, solve


def brute_force(costs: list[list[int]], damages: list[list[float]], budget: int) -> float:
    best = float("inf")
    for options in itertools.product(*(range(len(unit)) for unit in costs)):
        cost = sum(unit[o] for unit, o in zip(costs, options, strict=True))
        if cost <= budget:
            best = min(best, sum(unit[o] for unit, o in zip(damages, options, strict=True)))
    return best


def random_problem(rng: random.Random, units: int, options: int, top: int) -> tuple:
    costs = [[rng.randint(1, top) for _ in range(options)] for _ in range(units)]
    damages = [[rng.random() * 10 for _ in range(options)] for _ in range(units)]
    return costs, damages


@pytest.mark.parametrize("seed", range(40))
def test_solver_equals_brute_force_and_fits(seed: int) -> None:
    rng = random.Random(seed)
    costs, damages = random_problem(rng, rng.randint(1, 6), rng.randint(2, 4), 50)
    cheapest, dearest = sum(map(min, costs)), sum(map(max, costs))
    budget = rng.randint(cheapest, dearest)
    choice = solve(costs, damages, budget)
    assert choice.cost <= budget
    assert choice.cost == sum(unit[o] for unit, o in zip(costs, choice.options, strict=True))
    assert choice.damage == pytest.approx(brute_force(costs, damages, budget), abs=1e-9)


def test_a_tie_keeps_the_cheaper_option() -> None:
    assert solve([[30, 10, 20]], [[0.0, 0.0, 0.0]], 100).options == [1]


def test_nothing_fits_is_refused_with_the_cheapest_cost() -> None:
    with pytest.raises(OverBudget) as refused:
        solve([[5, 7], [3, 9]], [[1.0, 0.0], [1.0, 0.0]], 7)
    assert refused.value.cheapest == 8


@pytest.mark.parametrize("seed", range(5))
def test_coarse_steps_never_overspend_and_lose_at_most_a_step_per_unit(seed: int) -> None:
    """Costs in the millions (bits of real linears): the table counts coarse steps, each cost
    rounded up, so the choice fits; it is at least as good as the exact optimum of a budget a
    step per unit smaller."""
    rng = random.Random(seed)
    costs, damages = random_problem(rng, 5, 3, 10**9)
    budget = (sum(map(min, costs)) + sum(map(max, costs))) // 2
    choice = solve(costs, damages, budget)
    assert choice.cost <= budget
    spare = budget - sum(map(min, costs))
    step = -(-spare // (1 << 17))
    assert choice.damage <= brute_force(costs, damages, budget - 5 * step) + 1e-9


def test_a_budget_that_buys_every_least_damage_gets_it_exactly() -> None:
    """At the top of the range (every unit at its costliest, least-damage option) the coarse
    steps must not cost the fit."""
    costs = [[10**9, 4 * 10**9], [3 * 10**9, 9 * 10**9]]
    damages = [[5.0, 0.0], [7.0, 0.0]]
    choice = solve(costs, damages, 13 * 10**9)
    assert choice.options == [1, 1] and choice.damage == 0.0
