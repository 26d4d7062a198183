"""Mixed precision to a budget: plan the budget (refused before any work when the cheapest
choice does not fit), measure each linear's damage under each candidate, solve for the least
total damage that fits, and count what the written files hold."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from llmq.calib.stats import CalibStats
from llmq.config import MixedConfig, QuantArgs
from llmq.config.mixed import DEFAULT_CANDIDATES
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint, read_safetensors_header, torch_dtype
from llmq.mixed.sensitivity import measure_damages, resolved_sensitivity
from llmq.mixed.solve import OverBudget, solve
from llmq.mixed.units import (
    KEPT,
    Candidate,
    Linear,
    SchemeCandidate,
    choice_units,
    scheme_candidates,
)
from llmq.progress import NO_PROGRESS, Progress


@dataclass(slots=True)
class Budget:
    """What the solver may spend, on what."""

    config: MixedConfig
    units: list[list[Linear]]  # linears sharing one scheme
    candidates: list[Candidate]  # config.candidates'
    spend: int  # bits the units may take together
    weights: int  # the decoder linears' weights, quantized or kept: what bits are averaged over
    kept_bits: int  # the decoder linears --ignore keeps dense

    @property
    def linears(self) -> list[Linear]:
        return [linear for unit in self.units for linear in unit]

    def costs(self) -> list[list[int]]:
        return [[sum(c.bits(one) for one in unit) for c in self.candidates] for unit in self.units]

    @property
    def most_bits(self) -> float:
        """Bits a weight with every unit at its costliest candidate: no budget buys more."""
        return (sum(max(unit) for unit in self.costs()) + self.kept_bits) / self.weights


def linear_of(ckpt: Checkpoint, name: str) -> Linear:
    info = ckpt.tensors[f"{name}.weight"]
    return Linear(name, info.shape[0], info.shape[1], torch_dtype(info.dtype))


def plan_budget(ckpt: Checkpoint, layers: list[list[Linear]], config: MixedConfig) -> Budget:
    """The budget of quantizing `layers` (each decoder layer's planned linears) under `config`;
    InputError when even the cheapest candidates do not fit."""
    planned = {linear.name for layer in layers for linear in layer}
    decoder = [name for index in range(ckpt.num_layers) for name in ckpt.layout.linear_names(index)]  # fmt: skip
    kept = [linear_of(ckpt, name) for name in decoder if name not in planned]
    kept_bits = sum(KEPT.bits(linear) for linear in kept)
    weights = sum(linear.numel for layer in layers for linear in layer) + sum(
        one.numel for one in kept
    )
    if config.target_bits is not None:
        spend = math.floor(config.target_bits * weights) - kept_bits
    else:
        assert config.max_size is not None
        stored = sum(math.prod(i.shape) * torch_dtype(i.dtype).itemsize for i in ckpt.tensors.values())  # fmt: skip
        spend = 8 * (config.max_size - stored) + sum(KEPT.bits(one) for layer in layers for one in layer)  # fmt: skip
    units = [
        unit
        for index, layer in enumerate(layers)
        for unit in choice_units(ckpt.layout.at(index), ckpt.layout.layer_prefix(index), layer)
    ]
    names = config.candidates or DEFAULT_CANDIDATES
    config = config.model_copy(update={"candidates": names})
    return checked_budget(Budget(config, units, scheme_candidates(names), spend, weights, kept_bits))  # fmt: skip


def checked_budget(budget: Budget) -> Budget:
    """`budget`, or InputError when even the cheapest candidates do not fit."""
    cheapest = sum(min(unit) for unit in budget.costs())
    if budget.spend < cheapest:
        raise _over_budget(budget, cheapest)
    return budget


def _over_budget(budget: Budget, cheapest: int) -> InputError:
    config = budget.config
    hint = "raise the budget, or add a cheaper candidate with --candidates"
    if config.target_bits is not None:
        need = (cheapest + budget.kept_bits) / budget.weights
        return InputError(f"--target-bits {config.target_bits:g}: the cheapest candidates store {need:.4f} bits a weight", hint=hint)  # fmt: skip
    assert config.max_size is not None
    need = config.max_size + (cheapest - budget.spend) // 8
    return InputError(f"--max-size {config.max_size}: the cheapest candidates write {need} bytes", hint=hint)  # fmt: skip


def fitted_schemes(chosen: dict[str, tuple[Candidate, Linear]]) -> dict[str, QuantArgs | None]:
    """Each linear's compressed-tensors arguments from `choose`'s choice (None: dense)."""
    schemes = {}
    for name, (candidate, linear) in chosen.items():
        assert isinstance(candidate, SchemeCandidate)
        schemes[name] = candidate.fitted(linear)
    return schemes


def choose(
    ckpt: Checkpoint,
    budget: Budget,
    input_ids: Tensor | None,
    stats: CalibStats | None = None,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    measured: dict[str, list[float]] | None = None,
) -> tuple[dict[str, tuple[Candidate, Linear]], dict[str, Any]]:
    """Each linear's candidate: the least total damage (as the config's sensitivity measures
    it) whose stored bits fit the budget; and llmq.json's record of the choice. `measured`:
    the damages, when an attempt at another budget of the same recipe measured them (filled
    here when empty, for the next attempt)."""
    sensitivity = resolved_sensitivity(ckpt, budget.config.sensitivity)
    config = budget.config.model_copy(update={"sensitivity": sensitivity})
    names = [candidate.name for candidate in budget.candidates]
    measured = {} if measured is None else measured
    if not measured:
        measured.update(measure_damages(
            ckpt, budget.linears, budget.candidates, config, input_ids, stats, progress=progress,
            device=device,
        ))  # fmt: skip
    damages = [[sum(measured[one.name][c] for one in unit) for c in range(len(names))] for unit in budget.units]  # fmt: skip
    try:
        choice = solve(budget.costs(), damages, budget.spend)
    except OverBudget as exc:  # checked_budget checked it
        raise AssertionError(exc) from None
    chosen, linears = {}, {}
    for unit, option in zip(budget.units, choice.options, strict=True):
        candidate = budget.candidates[option]
        for linear in unit:
            chosen[linear.name] = (candidate, linear)
            linears[linear.name] = {
                "candidate": candidate.name,
                "stored_as": candidate.stored_as(linear),
                "weights": linear.numel,
                "bits_per_weight": candidate.bits(linear) / linear.numel,
                "damage": measured[linear.name][option],
                "damages": dict(zip(names, measured[linear.name], strict=True)),
            }
    record = {
        **config.model_dump(exclude_none=True),
        "predicted_bits": (choice.cost + budget.kept_bits) / budget.weights,
        "predicted_damage": choice.damage,
        "linears": linears,
    }
    return chosen, record


def written_bits(folder: Path, ckpt: Checkpoint) -> float:
    """The bits a weight of `ckpt`'s decoder linears takes in the safetensors files in `folder`
    (every tensor under a linear's name: codes, scales, zero points, shape, or its dense weight)."""
    names = [name for index in range(ckpt.num_layers) for name in ckpt.layout.linear_names(index)]
    prefixes = tuple(f"{name}." for name in names)
    stored = 0
    for path in sorted(folder.glob("*.safetensors")):
        stored += sum(e.nbytes for key, e in read_safetensors_header(path).items() if key.startswith(prefixes))  # fmt: skip
    return 8 * stored / sum(linear_of(ckpt, name).numel for name in names)
