"""Gradual magnitude pruning during distillation (Zhu & Gupta 2017, arXiv 1710.01878).

The target sparsity follows the cubic schedule s(t) = s_f · (1 - (1 - (t - t0) / (t1 - t0))³),
recomputed at steps t0, t0 + Δ, ... and reached at t1, constant in between and after. At each
pruning step every decoder linear drops its rows' lowest-scored weights down to s(t)
(llmq.quant.masks, per row as `llmq prune` does) or, for an N:M pattern, the lowest
round(s(t) · M) of every M consecutive inputs, up to M - N. A weight once pruned stays pruned
(masks only shrink) and zero: llmq.distillation.masks masks its gradient and its value.

Scores: magnitude |W|, or Wanda's |W_ij|·‖x_j‖ with ‖x_j‖ from `InputNorms`, the running sums
of squares of each linear's inputs over the training forward passes since the previous pruning
step. The weights move while training, so the norms are the current model's, not the dense
one's; the first pruning step, having seen no input yet, measures its own batch once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from llmq.config import DistillConfig
from llmq.config.distill import GmpConfig
from llmq.distillation.masks import prunable_linears
from llmq.distillation.sharding import local
from llmq.quant.masks import Sparsity, magnitude_scores, pruned_mask, wanda_scores


def scheduled_sparsity(step: int, config: DistillConfig) -> float:
    """s(step) of the cubic schedule, as a share of each row's weights (for N:M, of M)."""
    gmp = _gmp(config)
    final = _final(gmp)
    start, end = gmp.start, gmp.end_step(config.max_steps)
    if step < start:
        return 0.0
    last_pruning = start + (min(step, end) - start) // gmp.every * gmp.every
    progress = 1.0 if step >= end else (last_pruning - start) / (end - start)
    return final * (1.0 - (1.0 - progress) ** 3)


def is_pruning_step(step: int, config: DistillConfig) -> bool:
    gmp = _gmp(config)
    start, end = gmp.start, gmp.end_step(config.max_steps)
    return start <= step <= end and ((step - start) % gmp.every == 0 or step == end)


class InputNorms:
    """Sums of squares [in_features] of every prunable linear's inputs, added up by forward
    pre-hooks in training mode (held-out evaluation does not count) until `reset`."""

    def __init__(self, model: nn.Module) -> None:
        linears = prunable_linears(model)
        self.squares = {
            name: torch.zeros(linear.in_features, device=linear.weight.device)
            for name, linear in linears.items()
        }
        for name, linear in linears.items():
            linear.register_forward_pre_hook(self._hook(self.squares[name]))

    @staticmethod
    def _hook(squares: Tensor) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def add(module: nn.Module, args: tuple[Any, ...]) -> None:
            if module.training:
                x = args[0].detach()
                squares.add_(x.float().reshape(-1, x.shape[-1]).square().sum(dim=0))

        return add

    @property
    def empty(self) -> bool:
        return all(not bool(squares.any()) for squares in self.squares.values())

    def reduce(self, combine: Callable[[Tensor], Tensor]) -> None:
        """Replace every process's sums by `combine` of them (a sum over processes), so that
        all processes choose the same masks."""
        names = list(self.squares)
        flat = combine(torch.cat([self.squares[name] for name in names]).cpu())
        for name, part in zip(names, flat.split([self.squares[n].numel() for n in names]), strict=True):  # fmt: skip
            self.squares[name].copy_(part)

    def reset(self) -> None:
        for squares in self.squares.values():
            squares.zero_()

    def state(self) -> dict[str, Tensor]:
        """The sums to save in a resume point (`load_state` restores them into `squares`)."""
        return {name: squares.cpu() for name, squares in self.squares.items()}


def prune_step(
    model: nn.Module,
    masks: dict[str, Tensor],
    step: int,
    config: DistillConfig,
    norms: InputNorms | None = None,
) -> None:
    """Bring every prunable linear to the schedule's sparsity at `step`, updating `masks`
    (name -> True where a weight stays) and zeroing what they drop. `norms`: score by Wanda's
    metric with these input norms, else by magnitude."""
    sparsity = _sparsity(scheduled_sparsity(step, config), _gmp(config))
    if sparsity is None:
        return
    for name, linear in prunable_linears(model).items():
        weight = local(linear.weight.data)  # whole rows, also when sharded
        if norms is None:
            scores = magnitude_scores(weight)
        else:
            scores = wanda_scores(weight, norms.squares[name].sqrt())
        keep = ~pruned_mask(scores, sparsity)
        if name in masks:
            keep &= masks[name]
        masks[name] = keep
        weight.mul_(keep)


def masks_from_zeros(model: nn.Module, step: int, config: DistillConfig) -> dict[str, Tensor]:
    """The GMP masks of a run resumed at `step`: the zeros of the weights it saved (training
    makes no exact zeros, so these are exactly the pruned weights)."""
    if step <= _gmp(config).start:
        return {}
    return {name: local(linear.weight.data) != 0 for name, linear in prunable_linears(model).items()}  # fmt: skip


def _gmp(config: DistillConfig) -> GmpConfig:
    assert config.gmp is not None, "gradual pruning without its gmp config"
    return config.gmp


def _final(gmp: GmpConfig) -> float:
    pattern = gmp.nm_pattern
    if pattern is not None:
        return (pattern[1] - pattern[0]) / pattern[1]
    return float(gmp.sparsity or 0.0)


def _sparsity(share: float, gmp: GmpConfig) -> Sparsity | None:
    """What a pruning step removes at `share`: a fraction of each row, or for N:M the
    round(share · M) smallest of every M inputs."""
    pattern = gmp.nm_pattern
    if pattern is None:
        return Sparsity(fraction=share) if share > 0 else None
    dropped = round(share * pattern[1])
    return Sparsity(pattern=(pattern[1] - dropped, pattern[1])) if dropped > 0 else None
