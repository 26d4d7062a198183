"""`evaluate_tasks`: task accuracy (lm-eval, offline) against a baseline, with paired gates."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmq.api.common import _open
from llmq.config import DEFAULT_CONFIDENCE
from llmq.errors import InputError
from llmq.progress import NO_PROGRESS, Progress

Thresholds = (
    float | dict[str, float] | None
)  # one value for every task, or per task ("*": the rest)


@dataclass(slots=True)
class TaskRow:
    task: str
    metric: str
    score: float
    items: int
    seconds: float
    cached: bool
    baseline: float | None = None
    paired: dict[str, Any] | None = None  # llmq.eval.gates.PairedDifference
    gates: list[dict[str, Any]] = field(default_factory=list)  # GateVerdict per gate

    @property
    def passed(self) -> bool | None:
        return None if not self.gates else all(gate["passed"] for gate in self.gates)


@dataclass(slots=True)
class TaskEvalResult:
    model: str
    baseline: str | None
    rows: list[TaskRow]
    protocol: dict[str, Any]

    @property
    def passed(self) -> bool | None:
        verdicts = [row.passed for row in self.rows if row.passed is not None]
        return None if not verdicts else all(verdicts)

    def to_dict(self) -> dict[str, Any]:
        rows = [{**asdict(row), "passed": row.passed} for row in self.rows]
        return {"model": self.model, "baseline": self.baseline, "tasks": rows,
                "protocol": self.protocol, "passed": self.passed}  # fmt: skip


def list_tasks() -> list[dict[str, str]]:
    from llmq.eval.tasks import BUILTIN_TASKS

    return [{"name": t.name, "description": t.description} for t in BUILTIN_TASKS.values()]


def evaluate_tasks(
    models: list[str | Path],
    tasks: list[str],
    *,
    baseline: str | Path | None = None,
    task_dir: str | Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    max_drop: Thresholds = None,
    min_recovery: Thresholds = None,
    confidence: float = DEFAULT_CONFIDENCE,
    use_cache: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> list[TaskEvalResult]:
    """Each task's score for every model (and the baseline, on the same items), lm-eval's tasks
    run offline. `max_drop` (absolute) and `min_recovery` (score / baseline) make gates, per
    task or for all; a gate fails only when the paired drop is significant at `confidence`
    and beyond its threshold (llmq.eval.gates)."""
    from llmq.eval.tasks import check_task_names
    from llmq.models import cache_dir

    folder = None if task_dir is None else Path(task_dir)
    _check(tasks, folder, limit, num_fewshot, confidence, batch_size)
    check_task_names(tasks, folder)
    gates = {kind: _per_task(value, tasks, kind) for kind, value in (("max_drop", max_drop), ("min_recovery", min_recovery))}  # fmt: skip
    if any(gates.values()) and baseline is None:
        raise InputError("--max-drop and --min-recovery compare with a baseline: give --baseline")
    checkpoints = [_open(m, progress) for m in models]
    base_ckpt = None if baseline is None else _open(baseline, progress)
    cache = cache_dir() / "task-scores" if use_cache else None
    options = {"task_dir": folder, "limit": limit, "num_fewshot": num_fewshot, "seed": seed,
               "batch_size": batch_size, "device": device}  # fmt: skip
    base_scores = None
    if base_ckpt is not None:
        base_scores = _scores(base_ckpt, tasks, options, cache, progress)
    protocol = {"tasks": tasks, "task_dir": None if folder is None else str(folder), "limit": limit,
                "num_fewshot": num_fewshot or 0, "seed": seed, "confidence": confidence,
                "statistic": "paired per-item difference, normal approximation",
                "lm_eval": "simple_evaluate, bootstrap_iters=0, log_samples"}  # fmt: skip
    results = []
    for ckpt in checkpoints:
        scores = _scores(ckpt, tasks, options, None, progress)  # a candidate is scored afresh
        rows = [_row(scores[t], None if base_scores is None else base_scores[t], gates, confidence) for t in tasks]  # fmt: skip
        results.append(TaskEvalResult(str(ckpt.path), None if base_ckpt is None else str(base_ckpt.path), rows, protocol))  # fmt: skip
    return results


def _check(tasks: list[str], task_dir: Path | None, limit: int | None, num_fewshot: int | None, confidence: float, batch_size: int) -> None:  # fmt: skip
    if not tasks:
        raise InputError("--tasks: give at least one task", hint="see `llmq eval --list-tasks`")
    if task_dir is not None and not task_dir.is_dir():
        raise InputError(f"--task-dir {task_dir}: not a folder")
    if limit is not None and limit < 1:
        raise InputError(f"--limit {limit}: must be >= 1")
    if num_fewshot is not None and num_fewshot < 0:
        raise InputError(f"--num-fewshot {num_fewshot}: must be >= 0")
    if not 0.5 <= confidence < 1:
        raise InputError(f"--confidence {confidence}: in [0.5, 1)")
    if batch_size < 1:
        raise InputError(f"--batch-size {batch_size}: must be >= 1")


def _per_task(value: Thresholds, tasks: list[str], kind: str) -> dict[str, float]:
    """The threshold of each gated task."""
    if value is None:
        return {}
    table = value if isinstance(value, dict) else {"*": value}
    unknown = sorted(set(table) - {*tasks, "*"})
    if unknown:
        raise InputError(f"--{kind.replace('_', '-')} {unknown[0]}=...: not one of --tasks")
    lowest = 0.0 if kind == "max_drop" else 1e-9  # a recovery of 0 would gate nothing
    for name, threshold in table.items():
        if not lowest <= threshold <= 1.0:
            raise InputError(f"--{kind.replace('_', '-')} {threshold} ({name}): a share in [0, 1]")  # fmt: skip
    return {t: table.get(t, table.get("*")) for t in tasks if t in table or "*" in table}  # type: ignore[misc]


def _scores(ckpt: Any, tasks: list[str], options: dict[str, Any], cache: Path | None, progress: Progress) -> Any:  # fmt: skip
    from llmq.eval.harness import score_tasks

    with progress.stage(f"{', '.join(tasks)} on {ckpt.path.name}"):
        return score_tasks(ckpt, tasks, cache=cache, **options)


def _row(scores: Any, base: Any, gates: dict[str, dict[str, float]], confidence: float) -> TaskRow:
    from llmq.eval.gates import judge, paired_difference

    row = TaskRow(scores.task, scores.metric, scores.score, len(scores.items), round(scores.seconds, 3), scores.cached)  # fmt: skip
    if base is None:
        return row
    if scores.items.keys() != base.items.keys():
        raise InputError(f"{scores.task}: model and baseline answered different items")
    ids = sorted(scores.items)
    pair = paired_difference([scores.items[i] for i in ids], [base.items[i] for i in ids], confidence=confidence)  # fmt: skip
    row.baseline, row.paired = pair.baseline, asdict(pair)
    for kind, table in gates.items():
        if scores.task in table:
            row.gates.append(asdict(judge(pair, kind, table[scores.task])))  # type: ignore[arg-type]
    return row
