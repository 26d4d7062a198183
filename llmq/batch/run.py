"""`run_batch`: many models x many recipes, on this machine or on a Ray cluster, resumable, with
one summary. A client of llmq.api, as the CLI is: each job is `llmq.api.chain.run`."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmq.batch.plan import BatchPlan, plan_batch
from llmq.batch.summary import summary, write_summary
from llmq.errors import InputError
from llmq.progress import NO_PROGRESS, Progress

__all__ = ["BatchResult", "plan_batch", "run_batch", "run_plan"]


@dataclass(slots=True)
class BatchResult:
    summary: dict[str, Any]  # what OUT/summary.json holds

    @property
    def exit_code(self) -> int:
        return int(self.summary["exit_code"])

    def to_dict(self) -> dict[str, Any]:
        return self.summary


def run_batch(
    jobs_file: str | Path,
    out: str | Path,
    *,
    parallel: int = 1,
    max_memory: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    ray: str | None = None,
    gpus_per_job: float = 0.0,
    on_update: Callable[[dict[str, dict[str, Any]]], None] | None = None,
    progress: Progress = NO_PROGRESS,
) -> BatchResult:
    """Run every job of JOBS_FILE (models x recipes) into OUT/<model>/<recipe>/: up to
    `parallel` at a time within `max_memory` bytes on this machine, or as Ray tasks (`ray`:
    "local", "auto" or a cluster address; `gpus_per_job` GPUs reserved for each). `resume`
    skips finished jobs whose model and recipe are unchanged and continues interrupted ones.
    Returns the summary also written to OUT."""
    plan = plan_batch(
        jobs_file, out, parallel=parallel, max_memory=max_memory, resume=resume,
        overwrite=overwrite,
    )  # fmt: skip
    return run_plan(
        plan, ray=ray, gpus_per_job=gpus_per_job, on_update=on_update, progress=progress
    )


def run_plan(
    plan: BatchPlan,
    *,
    ray: str | None = None,
    gpus_per_job: float = 0.0,
    on_update: Callable[[dict[str, dict[str, Any]]], None] | None = None,
    progress: Progress = NO_PROGRESS,
) -> BatchResult:
    started = time.time()
    if gpus_per_job < 0 or (gpus_per_job and ray is None):
        raise InputError(f"--gpus-per-job {gpus_per_job}: reserves GPUs for Ray tasks (--ray), >= 0")  # fmt: skip
    if ray is not None:
        from llmq.batch.ray_runner import check_ready

        check_ready(plan, ray, gpus_per_job)
    if plan.replace:  # --overwrite: the earlier batch's output goes only now (not on --dry-run)
        shutil.rmtree(plan.out)
        plan.replace = False
    (plan.state / "jobs").mkdir(parents=True, exist_ok=True)
    computed = share_windows(plan, progress)
    update = on_update or (lambda states: None)
    if ray is not None:
        from llmq.batch.ray_runner import run_on_ray

        results, stopped_by = run_on_ray(plan, ray, update, gpus_per_job)
    else:
        from llmq.batch.local import run_local

        results, stopped_by = run_local(plan, update)
    jobs = results + [_not_run(item) for item in plan.jobs if item.action in ("skip", "refuse")]
    extra = {
        "runner": f"ray {ray}" if ray else "local",
        "parallel": plan.parallel,
        "max_memory_bytes": plan.max_memory,
        "calibration_windows_computed": computed,
        "estimated_peak_bytes": {item.spec.id: item.peak_bytes for item in plan.jobs},
    }
    data = summary(
        jobs, out=plan.out, jobs_file=plan.jobs_file.path, started=started, extra=extra,
        stopped_by=stopped_by,
    )  # fmt: skip
    write_summary(data, plan.out)
    return BatchResult(data)


def share_windows(plan: BatchPlan, progress: Progress) -> int:
    """Compute each (model, calibration settings)'s windows once into the batch's shared folder
    (the jobs read them there); how many were computed now (not found from an earlier run)."""
    from llmq.calib.windows import model_windows, sharing_windows

    with sharing_windows(plan.state / "windows") as shared:
        for model_dir, cal in plan.windows:
            model_windows(model_dir, cal, progress)
    return len(plan.windows) - shared.reads


def _not_run(item: Any) -> dict[str, Any]:
    """A skipped job's earlier result, or a refused job's reason."""
    if item.action == "skip":
        return {**item.previous, "status": "skipped", "previous_status": item.previous["status"]}
    return {"id": item.spec.id, "key": item.spec.key, "status": "refused", "error": item.reason}
