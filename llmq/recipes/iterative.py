"""The recipe of `distill --prune iterative` (DistillConfig.iterative): rounds of one-shot pruning and distillation (ModelOpt's advice
above 50% sparsity: prune about 30%, repair, repeat).

Round r prunes the current student with `llmq prune --method M` (the layer pipeline, calibrated
on the training data in seq_len windows, its default number of them) to the schedule's sparsity
s_r (`round_sparsities`): cubic (the default), s (1 - (1 - r/R)^3), is Zhu & Gupta's GMP
schedule taken in R steps: most of the pruning early, while many weights are redundant, and the
last rounds small, so the last repair has less damage to undo (at 70% in 3 rounds it beat the
geometric schedule on both held-out texts, benchmarks/RESULTS.md); geometric, 1 - (1 - s)^(r/R),
removes the same share of the weights that remain every round. Structured rounds run `llmq
prune --structured --decoder-params (1 - s_r) / (1 - s_(r-1))`: the same densities, as a
share of the current decoder's parameters, by narrowing the MLP. Then the round distills from
the teacher for max_steps / R steps with the run's settings (seed + r - 1: each round draws its
own windows). The zeros a round leaves stay zero while it trains (llmq.distillation.masks: the
pruned student's record says it was pruned, so even a light first round keeps its zeros) and
score lowest in the next round's pruning.

The rounds are expanded into the stages of a recipe before anything runs (llmq.api.iterative
runs it); no torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmq.config import DistillConfig
from llmq.config.distill import IterativeConfig
from llmq.recipes.schema import ChainRecipe

_NOT_PER_ROUND = ("iterative", "max_steps", "seed")


def round_sparsities(target: float, rounds: int, schedule: str) -> list[float]:
    """The sparsity after each round: geometric, densities (1 - target)^(r / rounds); cubic,
    target (1 - (1 - r / rounds)^3)."""
    if schedule == "cubic":
        return [target * (1 - (1 - r / rounds) ** 3) for r in range(1, rounds + 1)]
    return [1 - (1 - target) ** (r / rounds) for r in range(1, rounds + 1)]


def _prune_stage(config: DistillConfig, iterative: IterativeConfig, round_number: int) -> dict[str, Any]:  # fmt: skip
    """Round r's one-shot pruning: to the round's sparsity, or structured, keeping the share of
    the current decoder's parameters that takes its density from the last round's to this one's."""
    schedule = round_sparsities(iterative.sparsity, iterative.rounds, iterative.schedule)
    sparsities = [0.0, *schedule]
    stage: dict[str, Any] = {"name": f"prune-{round_number}", "calib_text": config.train_text, "seq_len": config.seq_len}  # fmt: skip
    if iterative.method == "structured":
        keep = (1 - sparsities[round_number]) / (1 - sparsities[round_number - 1])
        return {**stage, "structured": True, "decoder_params": keep}
    return {**stage, "method": iterative.method, "sparsity": sparsities[round_number]}


def rounds_recipe(config: DistillConfig, teacher: str | Path, checkpoint_every: int | None) -> ChainRecipe:  # fmt: skip
    """The recipe of the rounds: prune-r then distill-r, for r = 1..rounds."""
    iterative = config.iterative
    assert iterative is not None, "rounds of a run without iterative pruning"
    per_round = {k: v for k, v in config.model_dump().items() if k not in _NOT_PER_ROUND}
    steps = config.max_steps // iterative.rounds
    stages: list[dict[str, Any]] = []
    for r in range(1, iterative.rounds + 1):
        stages.append({"prune": _prune_stage(config, iterative, r)})
        stages.append({"distill": {
            **per_round, "name": f"distill-{r}", "teacher": str(teacher), "max_steps": steps,
            "seed": config.seed + r - 1, "checkpoint_every": checkpoint_every,
        }})  # fmt: skip
    return ChainRecipe.model_validate({"stages": stages})
