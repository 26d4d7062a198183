"""`llmq run RECIPE` (a recipe's stages, each into its own folder) and `llmq recipe show|check`."""

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
from llmq.cli.help import LlmqCommand
from llmq.cli.options import OUTPUT, Device, JsonFlag, Overwrite

RecipeArg = Annotated[Path, typer.Argument(help="Recipe file (YAML): stages of quantize, prune, distill and eval.")]  # fmt: skip


def run(
    recipe: RecipeArg,
    model: Annotated[
        str,
        typer.Option(
            metavar="MODEL",
            help="The model the first stage reads: a folder or a built-in name.",
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output folder: a numbered folder (or eval report) per stage, and llmq-run.json.",
            rich_help_panel=OUTPUT,
        ),
    ],
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue an interrupted run into OUT: finished stages are skipped.",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
    overwrite: Overwrite = False,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Run RECIPE's stages on --model, one after the other.

    Each stage reads the previous one's output and writes its own numbered folder in OUT; an
    eval stage is a gate (exit 1 when it fails, and the stages after it do not run). See
    docs/recipes.md.
    """
    quiet_libraries()
    from llmq.api.chain import run as run_recipe

    with cli_errors(), progress_bars(json_out=json_out) as progress:
        result = run_recipe(recipe, model, out, resume=resume, overwrite=overwrite, progress=progress, device=device)  # fmt: skip
    print_json(result.to_dict()) if json_out else render(result)
    if not result.passed:
        raise typer.Exit(1)


def render(result: Any) -> None:
    table = Table(title=f"{Path(result.model).name} through {len(result.recipe['stages'])} stages")
    for column in ("stage", "output", "seconds", "result"):
        table.add_column(column)
    for stage in result.stages:
        table.add_row(stage.name, stage.output, "earlier run" if stage.resumed else f"{stage.seconds:.1f}", _outcome(stage))  # fmt: skip
    out_console.print(table)
    verdict = ("PASS", "bold green") if result.passed else ("FAIL", "bold red")
    out_console.print(labelled(verdict[0], verdict[1], f"wrote {result.out_dir}"))


def _outcome(stage: Any) -> str:
    summary = stage.summary
    gate = {True: " PASS", False: " FAIL", None: ""}[stage.passed]
    if stage.kind == "eval" and "tasks" in summary:
        scores = ", ".join(f"{row['task']} {row['score']:.3f} ({row['paired']['difference']:+.3f})" for row in summary["tasks"])  # fmt: skip
        return scores + gate
    if stage.kind == "eval":
        increase = summary["increase"]
        return f"ppl {summary['model']['perplexity']:.3f} ({increase:+.2%} vs baseline){gate}"
    if stage.kind == "distill":
        return f"{summary['steps']} steps, {summary['tokens']:,} tokens"
    size = summary.get("size_bytes", {})
    written = size.get("output") or size.get("quantized")
    return f"{written / 1e6:.1f} MB" if written else "written"


recipe_app = typer.Typer(help="Check recipe files, or show them with defaults filled in.", no_args_is_help=True, rich_markup_mode=None)  # fmt: skip


@recipe_app.command("check", cls=LlmqCommand)
def check(recipe: RecipeArg) -> None:
    """Validate RECIPE as llmq run would, before any work.

    An error is one line naming the file, the line and the key (exit 2).
    """
    from llmq.api.chain import check_recipe

    with cli_errors():
        source = check_recipe(recipe)
    out_console.print(f"{recipe}: {counted(len(source.recipe.stages), 'stage')}, valid")


@recipe_app.command("show", cls=LlmqCommand)
def show(recipe: RecipeArg) -> None:
    """Print RECIPE with every default filled in.

    Every option of every stage, as it will run: YAML that loads back into the same recipe.
    """
    from llmq.api.chain import check_recipe
    from llmq.recipes.load import dump_recipe

    with cli_errors():
        source = check_recipe(recipe)
    typer.echo(dump_recipe(source.recipe), nl=False)
