"""`distill --prune iterative`: the rounds of prune and distill stages that
llmq.recipes.iterative expands the run into (its schedule is described there), run by
`llmq.api.chain.run` in OUT's staging folder: an interrupted run resumes in the stage it stopped
in, and a stage's folder is removed once the next one is written, so the disk holds about two
students at a time. The last round's student is published as OUT; its llmq.json adds each
round's sparsity (or parameters) and held-out perplexity after pruning and after distillation.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.config import DistillConfig
from llmq.progress import Progress

if TYPE_CHECKING:
    from llmq.api.train import DistillResult


def distill_iterative(
    teacher: str | Path,
    student: str | Path,
    out: str | Path,
    *,
    config: DistillConfig | None,
    max_tokens: int | None,
    checkpoint_every: int | None,
    resume_every_s: float,
    resume: bool,
    overwrite: bool,
    sharding: str,
    progress: Progress,
    device: str | None,
    **options: Any,
) -> DistillResult:
    """Run the rounds into OUT's staging folder and publish the last student as OUT; the
    `DistillResult` of the whole, with `rounds` filled."""
    from llmq.api.chain import run
    from llmq.api.common import _open
    from llmq.api.train import check_models, check_run, distill_config, distill_inputs
    from llmq.io.atomic import add_to_record, check_output_dir, claim_output, publish, staging_path
    from llmq.processes import launched
    from llmq.recipes.iterative import rounds_recipe

    teacher, student = _open(teacher, progress), _open(student, progress)
    check_models(teacher, student)
    world_size = launched().world_size
    config = config or distill_config(options, max_tokens, world_size)
    check_run(config, checkpoint_every, resume_every_s, world_size, sharding)
    out = Path(out)
    staging = staging_path(out)

    with claim_output(out, inputs=distill_inputs(teacher, student, config), kept=lambda: _kept(staging)):  # fmt: skip
        check_output_dir(out, overwrite=overwrite)
        chain = rounds_recipe(config, teacher.path, checkpoint_every)
        stages = run(
            chain, student.path, staging, resume=resume, overwrite=not resume,
            keep_stages=False, progress=progress, device=device,
        ).stages  # fmt: skip
        result = _result(stages, config, teacher.path, student.path, out)
        last = Path(stages[-1].output)
        add_to_record(last, distillation=_record(result))
        publish(last, out)
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _result(stages: list[Any], config: DistillConfig, teacher: Path, student: Path, out: Path) -> DistillResult:  # fmt: skip
    from llmq.api.train import DistillResult

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
