"""`llmq batch JOBS --out DIR`: models x recipes, resumable, on this machine or on Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

from llmq.cli.console import (
    cli_errors,
    counted,
    err_console,
    out_console,
    print_json,
    quiet_libraries,
)
from llmq.cli.options import OUTPUT, RUN, JsonFlag, Overwrite
from llmq.config.sizes import parse_size

RAY = "Ray"


def parse_memory(text: str | None) -> int | None:
    """'24GiB', '512M', '2g', or bytes."""
    return None if text is None else parse_size(text, "--max-memory")


def batch(
    jobs_file: Annotated[
        Path,
        typer.Argument(
            help="Jobs file (YAML): models:, recipes: and optionally only: (see docs/batch.md).",
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output folder: OUT/MODEL/RECIPE/ per job, logs/, summary.json and summary.md.",
            rich_help_panel=OUTPUT,
        ),
    ],
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            metavar="N",
            help="Jobs run at the same time (on this machine).",
            rich_help_panel=RUN,
        ),
    ] = 1,
    max_memory: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Memory the running jobs may use together, e.g. 16GiB (default: 90% of this "
            "machine's).",
            rich_help_panel=RUN,
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Continue an earlier batch into OUT: skip finished jobs, continue interrupted "
            "ones.",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
    overwrite: Overwrite = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            help="Show the jobs, their memory estimates and actions; run nothing.",
            rich_help_panel=RUN,
        ),
    ] = False,
    ray: Annotated[
        str | None,
        typer.Option(
            metavar="ADDRESS",
            help="Run the jobs as Ray tasks: local, auto (the running cluster) or an address.",
            rich_help_panel=RAY,
        ),
    ] = None,
    gpus_per_job: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="--ray: GPUs each job reserves (a fraction shares one).",
            rich_help_panel=RAY,
        ),
    ] = 0.0,
    json_out: JsonFlag = False,
) -> None:
    """Run every model x recipe of a jobs file into OUT.

    Each job runs atomically into its own folder; a failing job is recorded and the others go
    on. Exit 0 when every job passed, 1 when a gate failed, 2 when a job could not run (its
    error is in summary.md and its log), 130 when Ctrl-C stopped the batch (143 for SIGTERM;
    the summary is written). See docs/batch.md.
    """
    quiet_libraries()
    from llmq.batch.run import plan_batch, run_plan

    with cli_errors():
        plan = plan_batch(
            jobs_file, out, parallel=jobs, max_memory=parse_memory(max_memory), resume=resume,
            overwrite=overwrite,
        )  # fmt: skip
    if not json_out:
        out_console.print(plan_table(plan))
    if dry_run:
        if json_out:
            print_json([_planned(item) for item in plan.jobs])
        return
    with cli_errors():
        if json_out:
            result = run_plan(plan, ray=ray, gpus_per_job=gpus_per_job)
        else:  # the live table is the progress display (one Rich live display at a time)
            with Live(live_table({}), console=err_console, refresh_per_second=4) as live:
                result = run_plan(
                    plan, ray=ray, gpus_per_job=gpus_per_job,
                    on_update=lambda states: live.update(live_table(states)),
                )  # fmt: skip
    if json_out:
        print_json(result.to_dict())
    else:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(result.summary["counts"].items()))
        out_console.print(f"{counted(len(result.summary['jobs']), 'job')}: {counts}; wrote {out / 'summary.md'}")  # fmt: skip
        if result.summary.get("stopped_by"):
            err_console.print(f"stopped by {result.summary['stopped_by']}; continue with: --out {out} --resume")  # fmt: skip
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def _planned(item: Any) -> dict[str, Any]:
    return {"id": item.spec.id, "action": item.action, "reason": item.reason,
            "estimated_peak_bytes": item.peak_bytes, "key": item.spec.key}  # fmt: skip


def plan_table(plan: Any) -> Table:
    table = Table(title=f"{counted(len(plan.jobs), 'job')} from {plan.jobs_file.path}")
    for column in ("job", "stages", "est. peak", "action"):
        table.add_column(column)
    for item in plan.jobs:
        stages = " > ".join(entry.kind for entry in item.spec.recipe.stages)
        action = item.action + (f" ({item.reason})" if item.reason else "")
        table.add_row(item.spec.id, stages, f"{item.peak_bytes / 2**30:.1f} GiB", action)
    return table


def live_table(states: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="jobs")
    for column in ("job", "status", "stage", "progress", "elapsed"):
        table.add_column(column)
    for job_id, state in states.items():
        total = state.get("total")
        done = f"{state.get('done', 0)}/{total}" if total else ""
        seconds = state.get("seconds")
        table.add_row(job_id, state["status"], state.get("stage", ""), done,
                      "" if seconds is None else f"{seconds:.0f} s")  # fmt: skip
    return table
