"""`distill`: train a student (usually a pruned copy of the teacher) on the teacher's token
distributions and write it as a plain checkpoint; resumable, one process or many (torchrun).
One run of training (llmq.api.train), or with `iterative` pruning rounds of prune and distill
stages (llmq.api.iterative); the report adds held-out perplexities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmq.api.train import DistillResult, train
from llmq.config import DistillConfig
from llmq.config.distill import DISTILL_RESUME_EVERY_S
from llmq.progress import NO_PROGRESS, Progress

__all__ = ["DistillResult", "distill"]


def distill(
    teacher: str | Path,
    student: str | Path,
    out: str | Path,
    *,
    config: DistillConfig | None = None,
    max_tokens: int | None = None,
    checkpoint_every: int | None = None,
    resume_every_s: float = DISTILL_RESUME_EVERY_S,
    resume: bool = False,
    overwrite: bool = False,
    evaluate: bool = True,
    reference: bool = True,
    space_check: bool = True,
    sharding: str = "ddp",
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    **options: Any,
) -> DistillResult:
    """Distill TEACHER into STUDENT (both float checkpoints or built-in names, sharing a
    vocabulary) and write the trained student at OUT, shaped and typed like STUDENT.

    `config` (or its fields as keyword `options`; `max_tokens` in place of `max_steps`) says
    how. Run under `torchrun` it trains data-parallel, each process on its slice of every
    batch, with the student replicated (`sharding` "ddp") or the student, its optimizer state
    and the teacher sharded over the processes ("fsdp": FSDP2). A resume point is saved every
    `checkpoint_every` steps (else every `resume_every_s` seconds) in OUT's staging folder;
    `resume=True` continues from it to the result an uninterrupted run gives. `evaluate`:
    perplexity of teacher, student and result under `llmq eval`'s default protocol in the
    report."""
    from llmq.processes import launched

    run = {"config": config, "max_tokens": max_tokens, "checkpoint_every": checkpoint_every,
           "resume_every_s": resume_every_s, "resume": resume, "overwrite": overwrite,
           "sharding": sharding, "progress": progress, "device": device, **options}  # fmt: skip
    if (config.iterative if config else options.get("iterative")) is not None:
        from llmq.api.iterative import distill_iterative

        result = distill_iterative(teacher, student, out, **run)
    else:
        result = train(teacher, student, out, reference=reference, space_check=space_check, **run)  # fmt: skip
    if evaluate and launched().is_main:
        result.perplexity = _perplexities(teacher, student, result.out_dir, progress, device)  # fmt: skip
    return result


def _perplexities(
    teacher: str | Path, student: str | Path, out: Path, progress: Progress, device: str | None
) -> dict[str, Any]:
    """Teacher, student before and after, under `llmq eval`'s default protocol; `recovery`:
    the share of the student's perplexity gap to the teacher that distillation closed."""
    from llmq.api.evaluate import evaluate

    before = evaluate(student, baseline=teacher, progress=progress, device=device)
    after = evaluate(out, progress=progress, device=device)
    t, b, a = before.baseline.perplexity, before.model.perplexity, after.model.perplexity
    return {
        "teacher": t,
        "before": b,
        "after": a,
        "recovery": (b - a) / (b - t) if b != t else None,
        "protocol": before.protocol,
    }
