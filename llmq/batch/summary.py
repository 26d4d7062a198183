"""The batch's report: `summary.json` (schema `llmq.batch/1`) and `summary.md`, one row per job
sorted by model then recipe, and the exit code CI reads (0 every job passed, 1 a gate failed,
2 a job could not run, 128 + the signal's number when SIGINT or SIGTERM stopped the batch)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from llmq.io.atomic import write_json, write_text

SCHEMA = "llmq.batch/1"
EXIT_OK, EXIT_GATE, EXIT_ERROR = 0, 1, 2
NOT_RUN = ("failed", "refused", "interrupted", "not_started")


def exit_code(jobs: list[dict[str, Any]], stopped_by: int | None = None) -> int:
    """128 + the signal's number when a signal stopped the batch (130 for SIGINT, 143 for
    SIGTERM, as a shell reports a command the signal ended), else 2 when a job could not run,
    else 1 when a gate failed (this run's, or a skipped job's earlier run), else 0."""
    if stopped_by is not None:
        return 128 + stopped_by
    statuses = {job.get("previous_status", job["status"]) for job in jobs}
    if statuses & set(NOT_RUN):
        return EXIT_ERROR
    return EXIT_GATE if "gate_failed" in statuses else EXIT_OK


def summary(
    jobs: list[dict[str, Any]],
    *,
    out: Path,
    jobs_file: Path,
    started: float,
    extra: dict[str, Any],
    stopped_by: int | None = None,
) -> dict[str, Any]:
    """`stopped_by`: the signal that stopped the batch, if one did."""
    ordered = sorted(jobs, key=lambda job: job["id"])
    counts: dict[str, int] = {}
    for job in ordered:
        counts[job["status"]] = counts.get(job["status"], 0) + 1
    return {
        "schema": SCHEMA,
        "jobs_file": str(jobs_file),
        "out": str(out),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - started, 3),
        "counts": counts,
        "exit_code": exit_code(ordered, stopped_by),
        "stopped_by": None if stopped_by is None else signal.Signals(stopped_by).name,
        **extra,
        "jobs": ordered,
    }


def write_summary(data: dict[str, Any], out: Path) -> None:
    write_json(out / "summary.json", data)
    write_text(out / "summary.md", markdown(data))


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"# llmq batch: {data['jobs_file']}",
        "",
        f"{len(data['jobs'])} jobs, " + ", ".join(f"{n} {s}" for s, n in sorted(data["counts"].items()))
        + (f"; stopped by {data['stopped_by']}" if data.get("stopped_by") else "")
        + f"; exit code {data['exit_code']}; {data['seconds']:.0f} s.",
        "",
        "| job | status | seconds | peak memory | output | gates | error |",
        "|---|---|---:|---:|---:|---|---|",
    ]  # fmt: skip
    for job in data["jobs"]:
        gates = "; ".join(_gate_text(gate) for gate in job.get("gates", [])) or "-"
        lines.append(
            f"| {job['id']} | {job['status']} | {_num(job.get('seconds'), '{:.1f}')} | "
            f"{_bytes(job.get('peak_rss_bytes'))} | {_bytes(job.get('output_bytes'))} | "
            f"{gates} | {job.get('error') or ''} |"
        )
    return "\n".join(lines) + "\n"


def _gate_text(gate: dict[str, Any]) -> str:
    verdict = {True: "pass", False: "FAIL", None: "no gate"}[gate.get("passed")]
    if gate.get("ppl_increase") is not None:
        return f"{gate['stage']}: {verdict} (ppl +{gate['ppl_increase']:.1%})"
    return f"{gate['stage']}: {verdict}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _bytes(value: int | None) -> str:
    if not value:
        return "-"
    return f"{value / 2**20:.0f} MiB" if value < 2**30 else f"{value / 2**30:.2f} GiB"
