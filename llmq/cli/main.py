"""`llmq`: the Typer app. Importing this module must not import torch (`llmq --help` is fast)."""

from __future__ import annotations

import typer

from llmq.cli import (
    batch,
    bench,
    calibrate,
    distill,
    evaluate,
    fallback_scan,
    generate,
    models,
    prune,
    quantize,
    recipe,
    verify,
)

app = typer.Typer(
    name="llmq",
    help="Make LLM checkpoints smaller and faster without losing their accuracy.\n\n"
    "Exit codes: 0 ok, 1 an accuracy gate failed, 2 bad input or usage, or an output that "
    "cannot be written.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # "rich" read [x²] and [in, in] in help texts as style tags
)
app.command("quantize")(quantize.quantize)
app.command("prune")(prune.prune)
app.command("distill")(distill.distill)
app.command("calibrate")(calibrate.calibrate)
app.command("eval")(evaluate.evaluate)
app.command("fallback-scan")(fallback_scan.fallback_scan)
app.command("generate")(generate.generate)
app.command("bench")(bench.bench)
app.command("run")(recipe.run)
app.add_typer(recipe.recipe_app, name="recipe")
app.command("batch")(batch.batch)
app.command("models")(models.models)
app.command("verify")(verify.verify)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
