"""`distill --prune iterative`: rounds of one-shot pruning and distillation (ModelOpt's advice
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

The rounds are the stages of a recipe (`llmq run`) in OUT's staging folder: an interrupted run
resumes in the stage it stopped in, and a stage's folder is removed once the next one is written,
so the disk holds about two students at a time. The last round's student is published as OUT;
its llmq.json adds each round's sparsity (or parameters) and held-out perplexity after pruning
and after distillation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from llmq.config import DistillConfig
from llmq.progress import Progress

_NOT_PER_ROUND = ("prune", "prune_method", "sparsity", "pattern", "prune_start", "prune_end",
                  "prune_every", "rounds", "round_schedule", "max_steps", "seed")  # fmt: skip


def round_sparsities(target: float, rounds: int, schedule: str) -> list[float]:
    """The sparsity after each round: geometric, densities (1 - target)^(r / rounds); cubic,
    target (1 - (1 - r / rounds)^3)."""
    if schedule == "cubic":
        return [target * (1 - (1 - r / rounds) ** 3) for r in range(1, rounds + 1)]
    return [1 - (1 - target) ** (r / rounds) for r in range(1, rounds + 1)]


def _schedule(config: DistillConfig) -> list[float]:
    return round_sparsities(float(config.sparsity or 0), config.rounds, config.round_schedule)


def _prune_stage(config: DistillConfig, round_number: int) -> dict[str, Any]:
    """Round r's one-shot pruning: to the round's sparsity, or structured, keeping the share of
    the current decoder's parameters that takes its density from the last round's to this one's."""
    sparsities = [0.0, *_schedule(config)]
    stage: dict[str, Any] = {"name": f"prune-{round_number}", "calib_text": config.data, "seq_len": config.seq_len}  # fmt: skip
    if config.prune_method == "structured":
        keep = (1 - sparsities[round_number]) / (1 - sparsities[round_number - 1])
        return {**stage, "structured": True, "decoder_params": keep}
    return {**stage, "method": config.prune_method, "sparsity": sparsities[round_number]}


def distill_iterative(
    teacher: Any,
    student: Any,
    out: Path,
    config: DistillConfig,
    *,
    checkpoint_every: int | None,
    resume: bool,
    overwrite: bool,
    progress: Progress,
    device: str | None,
) -> Any:
    """Run the rounds into OUT's staging folder and publish the last student as OUT; the
    `DistillResult` of the whole, with `rounds` filled."""
    from llmq.api.chain import run
    from llmq.io.atomic import check_output_dir, claim_output, publish, staging_path, write_json

    staging = staging_path(out)
    from llmq.api.distill import distill_inputs

    with claim_output(out, inputs=distill_inputs(teacher, student, config), kept=lambda: _kept(staging)):  # fmt: skip
        check_output_dir(out, overwrite=overwrite)
        chain = rounds_recipe(config, teacher.path, checkpoint_every)
        stages = run(
            chain, student.path, staging, resume=resume, overwrite=not resume,
            keep_stages=False, progress=progress, device=device,
        ).stages  # fmt: skip
        result = _result(stages, config, teacher.path, student.path, out)
        last = Path(stages[-1].output)
        saved = json.loads((last / "llmq.json").read_text())
        write_json(last / "llmq.json", {**saved, "distillation": _record(result)})
        publish(last, out)
        shutil.rmtree(staging, ignore_errors=True)
    return result


def rounds_recipe(config: DistillConfig, teacher: Path, checkpoint_every: int | None) -> Any:
    """The recipe of the rounds: prune-r then distill-r, for r = 1..rounds."""
    from llmq.recipes.schema import ChainRecipe

    per_round = {k: v for k, v in config.model_dump().items() if k not in _NOT_PER_ROUND}
    steps = (config.max_steps or 0) // config.rounds
    stages: list[dict[str, Any]] = []
    for r in range(1, config.rounds + 1):
        stages.append({"prune": _prune_stage(config, r)})
        stages.append({"distill": {
            **per_round, "name": f"distill-{r}", "teacher": str(teacher), "max_steps": steps,
            "seed": config.seed + r - 1, "checkpoint_every": checkpoint_every,
        }})  # fmt: skip
    return ChainRecipe.model_validate({"stages": stages})


def _result(stages: list[Any], config: DistillConfig, teacher: Path, student: Path, out: Path) -> Any:  # fmt: skip
    from llmq.api.distill import DistillResult

    pruned = [s.summary for s in stages if s.kind == "prune"]
    trained = [s.summary for s in stages if s.kind == "distill"]
    rounds = [
        _round(r, p, d, s.seconds)
        for r, (p, d, s) in enumerate(zip(pruned, trained, stages[::2], strict=True), 1)
    ]
    step_seconds = sum(d["tokens"] / d["tokens_per_s"] for d in trained if d["tokens_per_s"])
    tokens = sum(d["tokens"] for d in trained)
    return DistillResult(
        out_dir=out, teacher=str(teacher), student=str(student),
        config=config.model_dump(mode="json"), steps=sum(d["steps"] for d in trained),
        tokens=tokens, epochs=sum(d["epochs"] for d in trained),
        seconds=round(sum(s.seconds for s in stages), 3),
        tokens_per_s=tokens / step_seconds if step_seconds else 0.0,
        kept_step=sum(d["steps"] for d in trained[:-1]) + trained[-1]["kept_step"],
        evaluations=_evaluations(trained),
        losses=[loss for d in trained for loss in d["losses"]],
        masked_linears=trained[-1]["masked_linears"], processes=1,
        sparsity=rounds[-1].get("sparsity"), rounds=rounds,
    )  # fmt: skip


def _round(number: int, pruned: dict[str, Any], trained: dict[str, Any], prune_seconds: float) -> dict[str, Any]:  # fmt: skip
    """One round's line of the report: the sparsity it reached and its held-out perplexity
    after pruning (distillation's step 0), after distillation, and of the student kept."""
    evaluations = trained["evaluations"]
    kept = next(e for e in reversed(evaluations) if e["step"] == trained["kept_step"])
    return {
        "round": number,
        **_pruned_to(pruned),
        "prune_seconds": prune_seconds,
        "perplexity_pruned": evaluations[0]["perplexity"],
        "perplexity_distilled": evaluations[-1]["perplexity"],
        "perplexity_kept": kept["perplexity"],
        "distill_seconds": trained["seconds"],
    }


def _pruned_to(pruned: dict[str, Any]) -> dict[str, Any]:
    """What a round's pruning reached: the linears' sparsity, or (structured) the parameters."""
    if "parameters" in pruned:
        return {"parameters": pruned["parameters"]["output"]}
    return {"sparsity": pruned["sparsity"]["linears"]}


def _evaluations(trained: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every round's held-out evaluations, numbered by the steps of the whole run."""
    evaluations, offset = [], 0
    for r, summary in enumerate(trained, 1):
        evaluations += [{**e, "step": e["step"] + offset, "round": r} for e in summary["evaluations"]]  # fmt: skip
        offset += summary["steps"]
    return evaluations


def _record(result: Any) -> dict[str, Any]:
    return {k: v for k, v in result.to_dict().items() if k not in ("out_dir", "perplexity")}


def _kept(staging: Path) -> str | None:
    if staging.exists():
        return f"finished rounds kept in {staging}: rerun the same command with --resume"
    return None
