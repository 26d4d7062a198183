"""`llmq verify`: prove where a checkpoint loads before it ships."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from llmq.cli.console import (
    cli_errors,
    labelled,
    out_console,
    print_json,
    progress_bars,
    quiet_libraries,
)
from llmq.cli.options import Device, JsonFlag, ModelArg, names, renamed

_STYLE = {"ok": "green", "does not load": "bold red", "wrong logits": "bold red", "wrong tokens": "bold red"}  # fmt: skip


def verify(
    model: ModelArg,
    loader: Annotated[
        list[str] | None,
        typer.Option(
            *renamed("--loader", "--loaders"),
            metavar="NAMES",
            help="Loaders to check: transformers, vllm, llmq; a GGUF file: transformers, llama.cpp "
            "($LLMQ_LLAMA_CPP or PATH) (commas or repeat; default: every installed one).",
        ),
    ] = None,
    baseline: Annotated[
        str | None,
        typer.Option(
            *renamed("--baseline", "--against"),
            metavar="MODEL",
            help="The original model: also report the checkpoint's distance from it.",
        ),
    ] = None,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Check which loaders load MODEL with the right logits.

    Loads MODEL with each loader, runs the prompts its llmq.json records and compares the
    log-probabilities with the reference llmq computed from the files it wrote; checks the
    files against their recorded SHA-256. A GGUF file is held to the model its tensors define
    on its source's architecture (the one it records, or --baseline). A loader ends as ok, does not load (the reason),
    wrong logits (how far off) or wrong tokens. Exit codes: 0 every loader ok and no file changed, 1 a loader
    failed or a file changed, 2 bad input. See docs/verify.md.
    """
    quiet_libraries()
    from llmq import api

    with cli_errors(), progress_bars(json_out=json_out) as progress:
        result = api.verify(
            model, loaders=names(loader) or None, against=baseline, progress=progress,
            device=None if device == "auto" else device,
        )  # fmt: skip
    if json_out:
        print_json(result.to_dict())
    else:
        render(result)
    if not result.passed:
        raise typer.Exit(1)


def render(result: Any) -> None:
    table = Table(title=f"verify {result.checkpoint}")
    table.add_column("loader")
    table.add_column("verdict", no_wrap=True)
    table.add_column("detail", overflow="fold")
    table.add_column("s", justify="right")
    for row in result.loaders:
        table.add_row(row.loader, row.status, row.detail, f"{row.seconds:.1f}", style=_STYLE[row.status])  # fmt: skip
    out_console.print(table)
    out_console.print(f"reference: {result.reference}", soft_wrap=True)
    if result.changed_files is None:
        out_console.print("files: no hashes recorded, not checked")
    elif result.changed_files:
        out_console.print(labelled("files changed since they were written:", "bold red", ", ".join(result.changed_files)), soft_wrap=True)  # fmt: skip
    else:
        out_console.print("files: unchanged since they were written (SHA-256)")
    if result.against is not None:
        a = result.against
        out_console.print(
            f"against {a['model']}: max |Δ log-prob| {a['max_abs']:.3g}, mean {a['mean_abs']:.3g}; "
            f"same top token at {a['top1_agreement']:.0%} of positions",
            soft_wrap=True,
        )
    verdict = ("PASS", "bold green") if result.passed else ("FAIL", "bold red")
    out_console.print(labelled(*verdict))
