"""`llmq eval`: held-out perplexity, side by side with a baseline, as a CI gate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from llmq.cli.console import (
    cli_errors,
    counted,
    labelled,
    out_console,
    print_json,
    progress_bars,
    quiet_libraries,
)
from llmq.cli.options import Device, JsonFlag, fraction, names, renamed
from llmq.config import DEFAULT_CONFIDENCE
from llmq.errors import InputError
from llmq.texts import DEFAULT_EVAL_TEXT

GATES, PERPLEXITY, TASKS = "Gates", "Perplexity", "Tasks"


def evaluate(
    models: Annotated[
        list[str] | None,
        typer.Argument(
            help="Checkpoint folders (quantized or not) or built-in names; one table for all.",
        ),
    ] = None,
    baseline: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL",
            help="Reference model scored on the same windows or items; the gates compare with it.",
            rich_help_panel=GATES,
        ),
    ] = None,
    eval_text: Annotated[
        str,
        typer.Option(
            *renamed("--eval-text", "--text"),
            metavar="TEXT",
            help="Held-out text: news, pydoc, shakespeare, or a .txt/.jsonl/.parquet file.",
            rich_help_panel=PERPLEXITY,
        ),
    ] = DEFAULT_EVAL_TEXT,
    seq_len: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Tokens per window (windows do not overlap).",
            rich_help_panel=PERPLEXITY,
        ),
    ] = 512,
    eval_windows: Annotated[
        int,
        typer.Option(
            *renamed("--eval-windows", "--max-windows"),
            metavar="N",
            help="Score at most this many windows from the start of the text.",
            rich_help_panel=PERPLEXITY,
        ),
    ] = 40,
    max_ppl_increase: Annotated[
        float | None,
        typer.Option(
            metavar="X",
            parser=fraction("--max-ppl-increase"),
            help="Exit 1 when perplexity rises more than this over --baseline, e.g. 3% or 0.03.",
            rich_help_panel=GATES,
        ),
    ] = None,
    no_cache: Annotated[
        bool,
        typer.Option(
            "--no-cache",
            help="Score the baseline again instead of reusing a cached result.",
            rich_help_panel=GATES,
        ),
    ] = False,
    tasks: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAMES",
            help="Score these lm-eval tasks instead of perplexity (commas or repeat).",
            rich_help_panel=TASKS,
        ),
    ] = None,
    task_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="A folder of your own lm-eval task YAMLs (reading local files).",
            rich_help_panel=TASKS,
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Score the first N items of each task.",
            rich_help_panel=TASKS,
        ),
    ] = None,
    num_fewshot: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Examples in each prompt.",
            rich_help_panel=TASKS,
        ),
    ] = None,
    max_drop: Annotated[
        list[str] | None,
        typer.Option(
            metavar="X",
            help="Exit 1 when a task scores this much below --baseline, significantly; TASK=X for "
            "one.",
            rich_help_panel=GATES,
        ),
    ] = None,
    min_recovery: Annotated[
        list[str] | None,
        typer.Option(
            metavar="X",
            help="Exit 1 when score / baseline score is below this, significantly; TASK=X for one.",
            rich_help_panel=GATES,
        ),
    ] = None,
    confidence: Annotated[
        float | None,
        typer.Option(
            metavar="X",
            parser=fraction("--confidence"),
            help="--max-drop, --min-recovery: the significance level (default 0.95).",
            rich_help_panel=GATES,
        ),
    ] = None,
    batch_size: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="lm-eval requests per forward pass.",
            rich_help_panel=TASKS,
        ),
    ] = 8,
    seed: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="lm-eval's seed (few-shot sampling).",
            rich_help_panel=TASKS,
        ),
    ] = 0,
    list_tasks: Annotated[
        bool,
        typer.Option(
            "--list-tasks",
            help="List the built-in tasks and exit.",
            rich_help_panel=TASKS,
        ),
    ] = False,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Score MODELS on held-out text or lm-eval tasks, with gates.

    Token perplexity on held-out text (W8A8 and FP8 activations really quantized per token),
    or with --tasks accuracy on lm-eval tasks, side by side with --baseline; a gate that fails
    exits 1. See docs/eval.md for the protocol and the gates.
    """
    quiet_libraries()
    from llmq import api
    from llmq.api.tasks import evaluate_tasks

    if list_tasks:
        _print_tasks(json_out)
        return
    if not models:
        with cli_errors():
            raise InputError("give at least one MODEL", hint="`llmq eval MODEL... [--baseline B]`")
    tasks = names(tasks) if tasks else None
    with cli_errors():
        _check_gates(tasks, max_ppl_increase, max_drop, min_recovery, confidence, task_dir, limit, num_fewshot)  # fmt: skip
    if tasks is not None:
        with cli_errors():
            gates = {"max_drop": _thresholds(max_drop, "--max-drop"), "min_recovery": _thresholds(min_recovery, "--min-recovery")}  # fmt: skip
            with progress_bars(json_out=json_out) as progress:
                task_results = evaluate_tasks(
                    models, tasks, baseline=baseline, task_dir=task_dir, limit=limit,
                    num_fewshot=num_fewshot, seed=seed, batch_size=batch_size,
                    confidence=DEFAULT_CONFIDENCE if confidence is None else confidence,
                    use_cache=not no_cache, progress=progress,
                    device=device, **gates,
                )  # fmt: skip
        print_json([r.to_dict() for r in task_results]) if json_out else render_tasks(task_results)
        if any(r.passed is False for r in task_results):
            raise typer.Exit(1)
        return
    with cli_errors(), progress_bars(json_out=json_out) as progress:
        results = [
            api.evaluate(
                model,
                baseline=baseline,
                text=eval_text,
                seq_len=seq_len,
                max_windows=eval_windows,
                max_ppl_increase=max_ppl_increase,
                use_cache=not no_cache,
                progress=progress,
                device=device,
            )
            for model in models
        ]
    if json_out:
        print_json([result.to_dict() for result in results])
    else:
        render(results)
    if any(result.passed is False for result in results):
        raise typer.Exit(1)


def _check_gates(
    tasks: list[str] | None,
    max_ppl_increase: float | None,
    max_drop: list[str] | None,
    min_recovery: list[str] | None,
    confidence: float | None,
    task_dir: Path | None,
    limit: int | None,
    num_fewshot: int | None,
) -> None:
    """Every option given does something: a threshold that would gate nothing (a task gate
    without --tasks, a --confidence without a task gate) is refused rather than passed by."""
    if tasks is None:
        task_only = {"--max-drop": max_drop, "--min-recovery": min_recovery, "--confidence": confidence,
                     "--task-dir": task_dir, "--limit": limit, "--num-fewshot": num_fewshot}  # fmt: skip
        given = [option for option, value in task_only.items() if value is not None]
        if given:
            raise InputError(
                f"{given[0]} applies to task accuracy: give --tasks",
                hint="perplexity is gated with --max-ppl-increase",
            )
    elif confidence is not None and not max_drop and not min_recovery:
        raise InputError("--confidence is the significance of a task gate: give --max-drop or --min-recovery")  # fmt: skip
    if max_ppl_increase is not None and tasks is not None:
        raise InputError("--max-ppl-increase gates perplexity; with --tasks use --max-drop or --min-recovery")  # fmt: skip


def _print_tasks(json_out: bool) -> None:
    from llmq.api.tasks import list_tasks

    found = list_tasks()
    if json_out:
        print_json(found)
        return
    for task in found:  # names first, one a line: easy to read by a script
        out_console.print(task["name"])
    out_console.print("")
    for task in found:
        out_console.print(f"{task['name']}: {task['description']}")


def _thresholds(values: list[str] | None, option: str) -> float | dict[str, float] | None:
    """["0.02"] -> 0.02; ["hamlet_cloze=0.02", "0.05"] -> {"hamlet_cloze": 0.02, "*": 0.05}."""
    if not values:
        return None
    table: dict[str, float] = {}
    for value in values:
        task, _, number = value.rpartition("=")
        table[task or "*"] = fraction(option)(number)
    return table["*"] if list(table) == ["*"] else table


def render_tasks(results: list[Any]) -> None:
    verdicts = {None: "", True: labelled("PASS", "green"), False: labelled("FAIL", "bold red")}
    for result in results:
        against = f" against {_name(result.baseline)}" if result.baseline else ""
        table = Table(title=f"{_name(result.model)}{against}")
        table.add_column("task")
        for column in ("items", "score", "baseline", "difference [CI]"):
            table.add_column(column, justify="right")
        table.add_column("gate")
        for row in result.rows:
            paired = row.paired
            diff = "-" if paired is None else f"{paired['difference']:+.3f} [{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}]"  # fmt: skip
            base = "-" if row.baseline is None else f"{row.baseline:.3f}"
            table.add_row(row.task, str(row.items), f"{row.metric} {row.score:.3f}", base, diff, verdicts[row.passed])  # fmt: skip
        out_console.print(table)
        for row in result.rows:
            for gate in row.gates:
                out_console.print(f"gate {row.task}: {gate['kind'].replace('_', '-')} {gate['threshold']:g}: {'past it' if gate['beyond'] else 'within it'}, drop {'significant' if gate['significant'] else 'not significant'}")  # fmt: skip
    p = results[0].protocol
    items = "all items" if p["limit"] is None else f"the first {p['limit']} items"
    out_console.print(
        f"protocol: lm-eval {', '.join(p['tasks'])}, {p['num_fewshot']}-shot, {items}, seed {p['seed']}; "
        f"gates: paired per-item differences, fail only when the drop is significant at {p['confidence']:.0%} and past the threshold"
    )


def _name(path: str) -> str:
    """A folder's last component: enough to tell rows apart, short enough for 80 columns."""
    return Path(path).name


def render(results: list[Any]) -> None:
    p = results[0].protocol
    gated = results[0].max_ppl_increase is not None
    table = Table(title="perplexity")
    table.add_column("model")
    table.add_column("perplexity", justify="right")
    table.add_column("increase", justify="right")
    if gated:
        table.add_column("gate")
    table.add_column("simulated (W: weights, A: activations)")
    table.add_column("size MB", justify="right")
    table.add_column("sparsity", justify="right")
    rows = []
    if results[0].baseline is not None:
        base = results[0].baseline
        size = _megabytes(results[0].size_bytes.get("baseline"))
        rows.append((_name(base.model), f"{base.perplexity:.3f}", "baseline", "", base.quantized, size, "-"))  # fmt: skip
    verdicts = {None: "", True: labelled("PASS", "green"), False: labelled("FAIL", "bold red")}
    for result in results:
        increase = "-" if result.increase is None else f"{result.increase:+.2%}"
        sparsity = "-" if result.sparsity is None else f"{result.sparsity:.1%}"
        rows.append(
            (_name(result.model.model), f"{result.model.perplexity:.3f}", increase,
             verdicts[result.passed], result.model.quantized,
             _megabytes(result.size_bytes.get("model")), sparsity)
        )  # fmt: skip
    for name, ppl, increase, verdict, simulated, size, sparsity in rows:
        table.add_row(name, ppl, increase, *([verdict] if gated else []), simulated, size, sparsity)
    out_console.print(table)
    out_console.print(
        f"protocol: {p['metric']}, text {p['text']}, {counted(p['windows'], 'window')} x {p['seq_len']} tokens "
        f"(stride {p['stride']}), BOS {'yes' if p['bos'] else 'no'}, {p['dtype']}, "
        f"{p['tokens_scored']} tokens scored"
    )
    if results[0].max_ppl_increase is not None:
        out_console.print(f"gate: perplexity increase at most {results[0].max_ppl_increase:+.2%}")


def _megabytes(size: int | None) -> str:
    return "-" if size is None else f"{size / 1e6:.1f}"
