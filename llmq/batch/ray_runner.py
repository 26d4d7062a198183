"""Jobs as Ray tasks on an existing cluster (`--ray ADDRESS` or `auto`) or on a Ray instance
started for the batch (`--ray local`). `pip install llmq[ray]`.

Each job is one task with the resources its estimate asks for (CPUs, memory) and the GPUs
`--gpus-per-job` gives it (Ray then sets CUDA_VISIBLE_DEVICES, and the job runs on its GPU). Policy: a worker or node that dies is retried by Ray up to
`MAX_RETRIES` times (the retry resumes from the job's resume points, as `--resume` does); an
application error (bad model, failing stage) is recorded in the job's result and never retried,
since it would fail again. Outputs go to OUT, which every worker must see: checked up front by
a task that writes and removes a file there.

SIGINT or SIGTERM stops as on one machine: tasks not started are cancelled, running ones get a
KeyboardInterrupt (each records "interrupted" and keeps its resume point), a second signal kills
their workers; the summary is written. A driver that dies (even by SIGKILL) takes its tasks
with it: Ray ends a job's tasks when its driver disconnects, and the Ray instance `--ray local`
starts shares the driver's fate.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from llmq.batch.local import Stopping, Update, _live
from llmq.batch.plan import BatchPlan, PlannedJob
from llmq.batch.worker import JobSpec, execute, failed_result, read_result
from llmq.errors import InputError
from llmq.io.atomic import write_json

MAX_RETRIES = 2
LOCAL_OBJECT_STORE_BYTES = 100 * 2**20  # the driver passes job specs and results, both small


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InputError("--ray needs Ray", hint="pip install 'llmq[ray]'") from None
    return ray


def connect(address: str) -> Any:
    """Ray, connected: `local` starts an instance on this machine (no dashboard, a small object
    store), `auto` finds the running cluster, anything else is the cluster's address. An
    instance this process already joined is reused."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    try:
        if address == "local":
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False)  # fmt: skip
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise InputError(f"--ray {address}: cannot connect ({str(exc).splitlines()[0]})") from None
    return ray


def _probe(out: str) -> str | None:
    """On a worker: None when it can write into OUT, else why not."""
    probe = Path(out) / f".llmq-ray-probe-{os.getpid()}"
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        return f"{exc.strerror or exc} ({os.uname().nodename})"
    return None


def _run_job(spec: JobSpec) -> dict[str, Any]:
    return execute(spec)


def check_ready(plan: BatchPlan, address: str, gpus_per_job: float = 0.0) -> None:
    """Before anything is written: Ray connects, a worker can write OUT, every job fits."""
    ray = connect(address)
    problem = ray.get(ray.remote(_probe).options(num_cpus=0).remote(str(plan.out.resolve())))
    if problem is not None:
        raise InputError(f"{plan.out}: a Ray worker cannot write there: {problem}",
                         hint="put --out on storage every node mounts at the same path")  # fmt: skip
    _check_memory(ray, plan)
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus_per_job > gpus:
        raise InputError(f"--gpus-per-job {gpus_per_job:g}: more than the Ray cluster's {gpus:g} GPUs")  # fmt: skip


def run_on_ray(
    plan: BatchPlan, address: str, on_update: Update, gpus_per_job: float = 0.0
) -> tuple[list[dict[str, Any]], int | None]:
    """The plan's runnable jobs as Ray tasks (after check_ready): their results, in the plan's
    order, and the signal that stopped the batch (None when every job ran)."""
    ray = connect(address)
    task = ray.remote(_run_job)
    refs: dict[Any, tuple[PlannedJob, float]] = {}
    for item in plan.jobs:
        if item.action in ("run", "resume"):
            write_json(Path(item.spec.started), {"key": item.spec.key, "id": item.spec.id})
            options = {"num_cpus": item.spec.threads, "num_gpus": gpus_per_job, "memory": item.peak_bytes,
                       "max_retries": MAX_RETRIES, "retry_exceptions": False, "name": item.spec.id}  # fmt: skip
            refs[task.options(**options).remote(item.spec)] = (item, time.monotonic())
    results: dict[str, dict[str, Any]] = {}
    running = {item.spec.id: (None, item, started) for item, started in refs.values()}
    stopping = Stopping()
    previous = {sig: signal.signal(sig, stopping) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while refs:
            if stopping.new:  # cancelled tasks are not retried
                for ref in refs:
                    ray.cancel(ref, force=stopping.count > 1)
                stopping.handled = stopping.count
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=0.2)
            for ref in ready:
                item, started = refs.pop(ref)
                results[item.spec.id] = _collect(ray, ref, item, started)
                running.pop(item.spec.id)
            on_update(_live(plan, running, results))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return [results[item.spec.id] for item in plan.jobs if item.spec.id in results], stopping.first


def _check_memory(ray: Any, plan: BatchPlan) -> None:
    """A task asking for more memory than the cluster has would wait forever: refuse it now."""
    available = ray.cluster_resources().get("memory", 0)
    for item in plan.jobs:
        if item.action in ("run", "resume") and item.peak_bytes > available:
            raise InputError(
                f"{item.spec.id}: needs about {item.peak_bytes / 2**30:.1f} GiB, more than the "
                f"Ray cluster's {available / 2**30:.1f} GiB of memory"
            )


def _collect(ray: Any, ref: Any, item: PlannedJob, started: float) -> dict[str, Any]:
    """A task's result; a task that failed past its retries (workers or nodes lost) is
    recorded as failed with Ray's reason."""
    try:
        return ray.get(ref)
    except ray.exceptions.TaskCancelledError:  # a signal stopped the batch
        result = read_result(Path(item.spec.result))
        if result is not None and result.get("key") == item.spec.key and result.get("status") == "interrupted":  # fmt: skip
            return result  # the task recorded its interruption before Ray reported the cancel
        return {"id": item.spec.id, "key": item.spec.key, "status": "interrupted",
                "error": "stopped by a signal; --resume continues it"}  # fmt: skip
    except ray.exceptions.RayError as exc:
        error = f"Ray: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        return failed_result(item.spec, error, time.monotonic() - started)
