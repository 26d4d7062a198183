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
from llmq.cli.help import LlmqCommand

app = typer.Typer(
    name="llmq",
    help="Make LLM checkpoints smaller and faster without losing their accuracy.\n\n"
    "Exit codes: 0 ok, 1 an accuracy gate failed, 2 bad input or usage, or an output that "
    "cannot be written.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help that wraps at 80 columns, in sections (llmq.cli.help)
)
app.command("quantize", cls=LlmqCommand)(quantize.quantize)
app.command("prune", cls=LlmqCommand)(prune.prune)
app.command("distill", cls=LlmqCommand)(distill.distill)
app.command("calibrate", cls=LlmqCommand)(calibrate.calibrate)
app.command("eval", cls=LlmqCommand)(evaluate.evaluate)
app.command("fallback-scan", cls=LlmqCommand)(fallback_scan.fallback_scan)
app.command("generate", cls=LlmqCommand)(generate.generate)
app.command("bench", cls=LlmqCommand)(bench.bench)
app.command("run", cls=LlmqCommand)(recipe.run)
app.add_typer(recipe.recipe_app, name="recipe")
app.command("batch", cls=LlmqCommand)(batch.batch)
app.command("models", cls=LlmqCommand)(models.models)
app.command("verify", cls=LlmqCommand)(verify.verify)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
