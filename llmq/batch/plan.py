"""What a batch will do, decided before any job runs: each job's key, memory estimate and action
(run, resume, skip, refuse), and the calibration windows the jobs will share.

OUT's layout:
    OUT/<model>/<recipe>/          a job's output (`llmq.api.chain.run`: a folder per stage)
    OUT/logs/<model>--<recipe>.log a job's log (every run appends)
    OUT/.batch/jobs/<model>--<recipe>.{started,result,status}.json
    OUT/.batch/windows/            calibration windows shared by the jobs
    OUT/summary.json, OUT/summary.md
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmq.batch.jobs import Job, JobsFile, job_key, load_jobs
from llmq.batch.memory import ModelSizes, job_peak
from llmq.batch.worker import JobSpec, read_result
from llmq.errors import InputError
from llmq.io.atomic import refuse_inputs

Action = Literal["run", "resume", "skip", "refuse"]
STATE_DIR = ".batch"
FINISHED = ("passed", "gate_failed")


@dataclass(slots=True)
class PlannedJob:
    job: Job
    spec: JobSpec
    peak_bytes: int
    action: Action
    reason: str = ""
    previous: dict[str, Any] | None = None  # a finished earlier run's result (skip)


@dataclass(slots=True)
class BatchPlan:
    jobs_file: JobsFile
    out: Path
    jobs: list[PlannedJob]
    max_memory: int
    parallel: int
    windows: list[tuple[Path, Any]]  # (model folder, CalibConfig) computed once each
    replace: bool = False  # OUT is an earlier batch's, removed when the run starts (--overwrite)

    @property
    def state(self) -> Path:
        return self.out / STATE_DIR


def machine_memory() -> int:
    """Physical memory of this machine, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_batch(
    jobs_path: str | Path,
    out: str | Path,
    *,
    parallel: int = 1,
    max_memory: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> BatchPlan:
    """Validate the jobs file and decide every job's action; nothing is written."""
    from llmq.models import resolve_model

    if parallel < 1:
        raise InputError(f"--jobs {parallel}: must be at least 1")
    out = Path(out)
    jobs_file = load_jobs(Path(jobs_path))
    _check_writable(out)
    replace = _check_out(out, resume=resume, overwrite=overwrite)
    memory = max_memory if max_memory is not None else int(0.9 * machine_memory())
    threads = max(1, (os.cpu_count() or 1) // parallel)
    folders = {m.name: resolve_model(m.spec) for m in jobs_file.models}
    refuse_inputs(out, _inputs(jobs_file, folders))
    sizes = {name: ModelSizes.of(_checkpoint(folder)) for name, folder in folders.items()}
    planned = []
    for job in jobs_file.jobs:
        stem = f"{job.model.name}--{job.recipe.name}"
        files = out / STATE_DIR / "jobs" / stem
        spec = JobSpec(
            id=job.id, model=str(folders[job.model.name]), recipe=job.recipe.source.recipe,
            key=job_key(job, folders[job.model.name]), out=str(out / job.model.name / job.recipe.name),
            log=str(out / "logs" / f"{stem}.log"), status=f"{files}.status.json",
            result=f"{files}.result.json", resume=False, threads=threads,
            shared_windows=str(out / STATE_DIR / "windows"),
        )  # fmt: skip
        peak = job_peak(job.recipe.source.recipe, sizes[job.model.name])
        planned.append(_decide(job, spec, peak, memory, resume))
    windows = _shared_windows(planned, folders)
    return BatchPlan(jobs_file, out, planned, memory, parallel, windows, replace=replace)


def _checkpoint(folder: Path) -> Any:
    from llmq.io.checkpoint import open_checkpoint

    return open_checkpoint(folder)


def _inputs(jobs_file: JobsFile, folders: dict[str, Path]) -> list[tuple[str, Path | None]]:
    """What the batch reads, as inputs OUT may not cover: the jobs file, the models, the
    recipe files and what their stages read."""
    recipes = [entry.source for entry in jobs_file.recipes]
    return [
        ("jobs file", jobs_file.path),
        *(("model", folder) for folder in folders.values()),
        *(("recipe", source.path) for source in recipes),
        *(found for source in recipes for found in source.recipe.inputs()),
    ]


def _check_out(out: Path, *, resume: bool, overwrite: bool) -> bool:
    """OUT is new, or an earlier batch's (resume, or overwrite); never a folder llmq did not
    make. True when OUT is to be replaced (an earlier batch's, --overwrite)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    ours = (out / STATE_DIR).is_dir()
    if resume and ours:
        return False
    if overwrite and ours:
        return True
    if not ours:
        raise InputError(
            f"{out}: exists and is not an `llmq batch` output", hint="choose another --out"
        )
    raise InputError(f"{out}: an earlier batch's output", hint="--resume continues it, --overwrite starts over")  # fmt: skip


def _check_writable(out: Path) -> None:
    """OUT, or the folder it will be made in, can be written: a read-only file system, a folder
    we may not write or a file in the way is one OutputError now, before the plan is shown or
    anything written (nothing is written to find out)."""
    from llmq.io.atomic import output_error

    where = out.absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        problem = errno.ENOTDIR
    elif os.statvfs(where).f_flag & os.ST_RDONLY:
        problem = errno.EROFS
    elif not os.access(where, os.W_OK | os.X_OK):
        problem = errno.EACCES
    else:
        return
    raise output_error(OSError(problem, os.strerror(problem), str(out)))


def _decide(job: Job, spec: JobSpec, peak: int, memory: int, resume: bool) -> PlannedJob:
    from dataclasses import replace

    if peak > memory:
        reason = f"needs about {peak / 2**30:.1f} GiB, more than --max-memory {memory / 2**30:.1f} GiB"  # fmt: skip
        return PlannedJob(job, spec, peak, "refuse", reason)
    if not resume:
        return PlannedJob(job, spec, peak, "run")
    previous = read_result(Path(spec.result))
    if previous and previous.get("key") == spec.key and previous.get("status") in FINISHED:
        return PlannedJob(job, spec, peak, "skip", "finished by an earlier run", previous)
    started = read_result(Path(spec.started))
    if started and started.get("key") == spec.key:
        return PlannedJob(job, replace(spec, resume=True), peak, "resume")
    reason = "the recipe or the model changed" if started else ""
    return PlannedJob(job, spec, peak, "run", reason)


def _shared_windows(planned: list[PlannedJob], folders: dict[str, Path]) -> list[tuple[Path, Any]]:
    """(model, calibration settings) of every job's first layer-pipeline stage, once per
    distinct windows (models with the same tokenizer share them)."""
    from llmq.api.chain import pipeline_recipe
    from llmq.calib.windows import windows_key

    seen: dict[str, tuple[Path, Any]] = {}
    for item in planned:
        if item.action in ("skip", "refuse"):
            continue
        for entry in item.spec.recipe.stages:
            if entry.kind in ("quantize", "prune") and not getattr(entry.stage, "structured", False):  # fmt: skip
                cal = pipeline_recipe(entry).calibration
                if cal is not None:
                    folder = folders[item.job.model.name]
                    seen.setdefault(windows_key(folder, cal), (folder, cal))
                break
    return list(seen.values())
