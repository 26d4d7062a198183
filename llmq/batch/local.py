"""Jobs on this machine: one child process per job (forked from a server that imported llmq once),
up to `parallel` at a time, admitted while the running jobs' estimated peaks leave room.

A job that raises is recorded by its worker; a child that dies (killed, out of memory) is
recorded here from its exit code. SIGINT or SIGTERM stops admitting, passes SIGINT to the
running jobs (each keeps its resume point) and waits for them; a second signal kills them.
Every worker reads the driver's lifeline pipe and kills itself when the driver dies (see
`worker._die_with_driver`); the forkserver then exits with the last worker.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmq.batch.plan import BatchPlan, PlannedJob
from llmq.batch.worker import execute, failed_result, read_result
from llmq.io.atomic import write_json

POLL_S = 0.2
Update = Callable[[dict[str, dict[str, Any]]], None]  # job id -> live state


class Stopping:
    """Counts SIGINT/SIGTERM received while the batch runs."""

    def __init__(self) -> None:
        self.count = 0  # signals received
        self.handled = 0  # signals already passed on to the jobs
        self.first: int | None = None  # the signal that stopped the batch

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.first is None:
            self.first = signum

    @property
    def new(self) -> bool:
        return self.count > self.handled


def run_local(plan: BatchPlan, on_update: Update) -> tuple[list[dict[str, Any]], int | None]:
    """Run the plan's runnable jobs: their results, in the plan's order, and the signal that
    stopped the batch (None when every job ran)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["llmq.batch.worker", "llmq.api.chain", "torch", "transformers"])
    pending = [item for item in plan.jobs if item.action in ("run", "resume")]
    running: dict[str, tuple[Any, PlannedJob, float]] = {}
    results: dict[str, dict[str, Any]] = {}
    stopping = Stopping()
    previous = {sig: signal.signal(sig, stopping) for sig in (signal.SIGINT, signal.SIGTERM)}
    # the workers' lifeline: only this process holds the write end, so it closes when we die
    lifeline, alive = context.Pipe(duplex=False)
    try:
        while pending or running:
            if stopping.new:
                pending = _stop(pending, running, stopping, results)
            for item in _admissible(pending, running, plan):
                pending.remove(item)
                write_json(Path(item.spec.started), {"key": item.spec.key, "id": item.spec.id})
                process = context.Process(
                    target=execute, args=(item.spec,), kwargs={"lifeline": lifeline},
                    name=item.spec.id,
                )  # fmt: skip
                process.start()
                running[item.spec.id] = (process, item, time.monotonic())
            for job_id, (process, item, started) in list(running.items()):
                if not process.is_alive():
                    process.join()
                    results[job_id] = _outcome(item, process.exitcode, started)
                    del running[job_id]
            on_update(_live(plan, running, results))
            time.sleep(POLL_S)
    finally:
        alive.close()  # a worker still running (the driver failed) dies now, as with a kill
        lifeline.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    on_update(_live(plan, running, results))
    return [results[item.spec.id] for item in plan.jobs if item.spec.id in results], stopping.first


def _admissible(
    pending: list[PlannedJob], running: dict[str, tuple[Any, PlannedJob, float]], plan: BatchPlan
) -> list[PlannedJob]:
    """Pending jobs that start now, in order: up to `parallel` running, and the running jobs'
    estimated peaks plus theirs within --max-memory (a job that fits alone always starts
    eventually: it waits until enough has finished)."""
    chosen = []
    used = sum(item.peak_bytes for _, item, _ in running.values())
    slots = plan.parallel - len(running)
    for item in pending:
        if slots <= 0:
            break
        if used + item.peak_bytes <= plan.max_memory:
            chosen.append(item)
            used += item.peak_bytes
            slots -= 1
    return chosen


def _stop(
    pending: list[PlannedJob],
    running: dict[str, tuple[Any, PlannedJob, float]],
    stopping: Stopping,
    results: dict[str, dict[str, Any]],
) -> list[PlannedJob]:
    """No more admissions; SIGINT to the running jobs at the first signal (each keeps its
    resume point), SIGKILL at the next."""
    for item in pending:
        results[item.spec.id] = {"id": item.spec.id, "status": "not_started", "key": item.spec.key}  # fmt: skip
    for process, _, _ in running.values():
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL if stopping.count > 1 else signal.SIGINT)
    stopping.handled = stopping.count
    return []


def _outcome(item: PlannedJob, exitcode: int | None, started: float) -> dict[str, Any]:
    """The worker's result, or, when it died before writing one, why."""
    result = read_result(Path(item.spec.result))
    if result is not None and result.get("key") == item.spec.key and exitcode == 0:
        return result
    reason = f"the job's process ended with exit code {exitcode}"
    if exitcode is not None and exitcode < 0:
        reason = f"the job's process was killed by {signal.Signals(-exitcode).name}"
    return failed_result(item.spec, reason, time.monotonic() - started)


def _live(
    plan: BatchPlan,
    running: dict[str, tuple[Any, PlannedJob, float]],
    results: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Every job's state for the live table: waiting, running (stage, steps), or its result."""
    states = {}
    for item in plan.jobs:
        job_id = item.spec.id
        if job_id in results:
            states[job_id] = {"status": results[job_id]["status"], "seconds": results[job_id].get("seconds")}  # fmt: skip
        elif job_id in running:
            status = read_result(Path(item.spec.status)) or {}
            elapsed = time.monotonic() - running[job_id][2]
            states[job_id] = {"status": "running", "seconds": elapsed, **status}
        else:
            states[job_id] = {"status": {"skip": "skipped", "refuse": "refused"}.get(item.action, "waiting")}  # fmt: skip
    return states
