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
    parse_fraction,
    print_json,
    progress_bars,
    quiet_libraries,
)
from llmq.cli.options import Device, JsonFlag
from llmq.texts import DEFAULT_EVAL_TEXT


def evaluate(
    models: Annotated[
        list[str],
        typer.Argument(
            help="Checkpoint folders (quantized or not) or built-in names; one table for all."
        ),
    ],
    baseline: Annotated[
        str | None,
        typer.Option(
            help="Reference model scored on the same windows (cached after the first run)."
        ),
    ] = None,
    text: Annotated[
        str,
        typer.Option(
            help="Held-out text: news, pydoc, shakespeare (its held-out splits), or a .txt/.jsonl/.parquet file."
        ),
    ] = DEFAULT_EVAL_TEXT,
    seq_len: Annotated[int, typer.Option(help="Tokens per window (windows do not overlap).")] = 512,
    max_windows: Annotated[
        int, typer.Option(help="Score at most this many windows from the start of the text.")
    ] = 40,
    max_ppl_increase: Annotated[
        str | None,
        typer.Option(
            help="Gate: exit 1 when perplexity rises more than this over --baseline, e.g. 3% or 0.03."
        ),
    ] = None,
    no_cache: Annotated[
        bool,
        typer.Option(
            "--no-cache", help="Score the baseline again instead of reusing a cached result."
        ),
    ] = False,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Token perplexity of MODELS on held-out text; W8A8/FP8 activations really quantized per token."""
    quiet_libraries()
    from llmq import api

    with cli_errors():
        gate = parse_fraction(max_ppl_increase, "--max-ppl-increase")
        with progress_bars(json_out=json_out) as progress:
            results = [
                api.evaluate(
                    model,
                    baseline=baseline,
                    text=text,
                    seq_len=seq_len,
                    max_windows=max_windows,
                    max_ppl_increase=gate,
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
