"""One batch job, run where a worker runs it (a child process on this machine, or a Ray task):
the recipe through `llmq.api.chain.run` into the job's folder, its log, its live status and its
result file. Every application error ends as a result with status "failed" (never an exception
out of the worker), so only a worker's death is left to retry.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmq.io.atomic import write_json
from llmq.recipes.schema import ChainRecipe

STATUS_EVERY_S = 0.5  # how often a job's live status file is rewritten at most


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a worker needs to run one job; plain data, so that it pickles to any worker."""

    id: str
    model: str  # a built-in name or a folder
    recipe: ChainRecipe
    key: str  # job_key: what the output depends on
    out: str  # the job's output folder
    log: str
    status: str  # live status file (stage, steps) for the driver's table
    result: str  # the job's result file
    resume: bool  # continue an interrupted run of the same key
    threads: int  # torch CPU threads
    shared_windows: str  # the batch's shared calibration windows folder

    @property
    def started(self) -> str:
        """Written by the driver when the job starts: its key, for --resume."""
        return self.result.replace(".result.json", ".started.json")


class StatusProgress:
    """llmq's Progress protocol written to the job's status file, for the driver to show."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # the pid lets an operator (or a test) find the process running the job
        self.state: dict[str, Any] = {"stage": "starting", "done": 0, "total": None}
        self.pid = os.getpid()
        self.written = 0.0

    @contextlib.contextmanager
    def stage(self, description: str, total: int | None = None, *, transient: bool = False):
        outer = dict(self.state)
        self.state = {"stage": description, "done": 0, "total": total}
        self._write(force=True)

        def advance(steps: int = 1, status: str | None = None) -> None:
            self.state["done"] += steps
            if status is not None:  # loss, speed: not the job's status
                self.state["detail"] = status
            self._write()

        try:
            yield advance
        finally:
            self.state = outer
            self._write(force=True)

    def _write(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.written >= STATUS_EVERY_S:
            self.written = now
            with contextlib.suppress(OSError):  # a status is a courtesy, never a failure
                write_json(self.path, {**self.state, "pid": self.pid})


def execute(spec: JobSpec, *, lifeline: Any = None) -> dict[str, Any]:
    """Run one job and return (and write) its result. `lifeline`: the read end of a pipe whose
    write end only the driver holds, given when this process exists for the job alone (it
    dies with the driver, logs into the job's file and stops at the first SIGINT); None in a
    shared worker (Ray's)."""
    child = lifeline is not None
    if child:
        _die_with_driver(lifeline)
        signal.signal(signal.SIGINT, _interrupt_once)
    Path(spec.log).parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log, "a", buffering=1) as log, _redirected(log, child):
        return _run(spec, log)


def _run(spec: JobSpec, log: Any) -> dict[str, Any]:
    import torch

    from llmq.api.chain import run
    from llmq.calib.windows import sharing_windows
    from llmq.errors import LlmqError

    torch.set_num_threads(spec.threads)
    started = time.perf_counter()
    print(f"== {spec.id}: {time.strftime('%Y-%m-%d %H:%M:%S')}, resume={spec.resume}", file=log)
    result: dict[str, Any] = {"id": spec.id, "key": spec.key, "out": spec.out, "log": spec.log}
    try:
        with sharing_windows(spec.shared_windows) as shared:
            outcome = run(
                spec.recipe, spec.model, spec.out, resume=spec.resume, overwrite=not spec.resume,
                progress=StatusProgress(Path(spec.status)),
            )  # fmt: skip
        result["status"] = "passed" if outcome.passed else "gate_failed"
        result["stages"] = [asdict(stage) for stage in outcome.stages]
        result["gates"] = [_gate(stage) for stage in outcome.stages if stage.kind == "eval"]
    except KeyboardInterrupt:
        result.update(status="interrupted", error="stopped by a signal; --resume continues it")
    except Exception as exc:  # any application error: recorded, the batch goes on
        traceback.print_exc(file=log)
        message = exc.message if isinstance(exc, LlmqError) else f"{type(exc).__name__}: {exc}"
        result.update(status="failed", error=str(message).splitlines()[0])
    result["seconds"] = round(time.perf_counter() - started, 3)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["output_bytes"] = _tree_bytes(Path(spec.out))
    result["shared_windows_reads"] = shared.reads
    write_json(Path(spec.result), result)
    print(f"== {spec.id}: {result['status']} in {result['seconds']:.1f} s", file=log)
    return result


def _gate(stage: Any) -> dict[str, Any]:
    """An eval stage's verdict and what it measured: the perplexity increase and its limit, or
    each task's accuracy drop."""
    summary = stage.summary
    gate: dict[str, Any] = {"stage": stage.name, "passed": stage.passed}
    if "increase" in summary:
        gate.update(ppl_increase=summary["increase"], max_ppl_increase=summary["max_ppl_increase"])
    for row in summary.get("tasks", []):
        gate[row["task"]] = {k: row.get(k) for k in ("metric", "score", "baseline", "passed")}
    return gate


def _tree_bytes(folder: Path) -> int:
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _die_with_driver(lifeline: Any) -> None:
    """SIGKILL this worker when the driver dies, however it dies (SIGKILL included), so that
    no orphan keeps running, writing and holding its output's lock. The kernel closes the
    driver's end of the lifeline when the driver dies, and a thread reading this end then
    reads end-of-file. (PR_SET_PDEATHSIG cannot do this: a worker's parent is the forkserver,
    and the forkserver lives as long as any worker does.)"""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                lifeline.recv_bytes()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="llmq-lifeline", daemon=True).start()


def _interrupt_once(signum: int, frame: Any) -> None:
    """The first SIGINT stops the job (the KeyboardInterrupt records it as interrupted); the
    next ones are ignored, so that the same Ctrl-C, sent by the terminal and passed on by the
    driver, cannot interrupt the recording. The driver's SIGKILL still stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _redirected(log: Any, child: bool):
    """Output into the job's log: in a child of its own, fds 1 and 2 (libraries' output too);
    in a shared worker (Ray's), Python's streams only, for the job's duration."""
    if not child:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    yield


def failed_result(spec: JobSpec, error: str, seconds: float) -> dict[str, Any]:
    """The result of a job whose worker died before writing its own (process killed, Ray
    task lost past its retries)."""
    return {"id": spec.id, "key": spec.key, "out": spec.out, "log": spec.log,
            "status": "failed", "error": error, "seconds": round(seconds, 3)}  # fmt: skip


def read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
