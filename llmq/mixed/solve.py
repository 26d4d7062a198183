"""The budget solver: one option per unit (a set of linears that share a scheme), least total
damage, total cost within the budget. A multiple-choice knapsack, solved exactly by dynamic
programming over the cost above each unit's cheapest option.

Costs are integers (bits). When each unit's least-damage option fits together, that is the
answer. Otherwise, where the budget above the cheapest choice exceeds RESOLUTION steps,
costs are counted in coarser steps, each option's rounded up: the choice then still fits (it is
never over the budget), and gives up at most one step per unit of what it could spend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

RESOLUTION = 1 << 17  # budget steps of the dynamic programme (its table: units x steps bytes)


class OverBudget(Exception):
    """Even the cheapest option of every unit costs more than the budget."""

    def __init__(self, cheapest: int) -> None:
        super().__init__(f"the cheapest choice costs {cheapest}")
        self.cheapest = cheapest


@dataclass(frozen=True, slots=True)
class Choice:
    options: list[int]  # each unit's chosen option
    cost: int
    damage: float


def solve(costs: list[list[int]], damages: list[list[float]], budget: int) -> Choice:
    """The options (one per unit) of least total damage whose total cost is at most `budget`.
    costs[u][o], damages[u][o]: unit u's option o. Among equal damages, the cheaper is kept."""
    cheapest = [min(unit) for unit in costs]
    spare = budget - sum(cheapest)
    if spare < 0:
        raise OverBudget(sum(cheapest))
    free = [min(range(len(c)), key=lambda o, c=c, d=d: (d[o], c[o])) for c, d in zip(costs, damages, strict=True)]  # fmt: skip
    if _total(costs, free) <= budget:  # each unit's least damage fits: no trade-off to make
        return Choice(free, _total(costs, free), _total(damages, free))
    step = max(1, -(-spare // RESOLUTION))
    steps = spare // step
    best = torch.zeros(steps + 1, dtype=torch.float64)  # least damage within each spend
    picks = []
    for unit_costs, unit_damages, floor in zip(costs, damages, cheapest, strict=True):
        table = torch.full((len(unit_costs), steps + 1), float("inf"), dtype=torch.float64)
        for option, (cost, damage) in enumerate(zip(unit_costs, unit_damages, strict=True)):
            extra = -(-(cost - floor) // step)  # rounded up: the choice never overspends
            if extra <= steps:
                table[option, extra:] = best[: steps + 1 - extra] + damage
        best, pick = _cheapest_minimum(table, unit_costs)
        picks.append(pick)
    options = []
    left = steps
    for unit_costs, floor, pick in zip(reversed(costs), reversed(cheapest), reversed(picks), strict=True):  # fmt: skip
        option = int(pick[left])
        options.append(option)
        left -= -(-(unit_costs[option] - floor) // step)
    options.reverse()
    return Choice(options, _total(costs, options), _total(damages, options))


def _total(values: list[list[Any]], options: list[int]) -> Any:
    return sum(unit[o] for unit, o in zip(values, options, strict=True))


def _cheapest_minimum(table: torch.Tensor, costs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per spend, the least damage over the options and which option gives it (options tried
    from the cheapest, so a tie keeps the cheaper)."""
    order = sorted(range(len(costs)), key=costs.__getitem__)
    values, position = table[order].min(dim=0)  # min returns the first of equal values
    return values, torch.tensor(order)[position]
