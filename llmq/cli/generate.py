"""`llmq generate`: greedy text from a quantized checkpoint running on llmq's kernels."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer
from rich.text import Text

from llmq.cli.console import cli_errors, err_console, out_console, print_json, quiet_libraries
from llmq.cli.options import Device, Dtype, JsonFlag, Kernels, ModelArg


def generate(
    model: ModelArg,
    prompt: Annotated[
        str,
        typer.Option(
            metavar="TEXT",
            help="Text to continue (no chat template is applied).",
        ),
    ],
    max_new_tokens: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Stop after this many new tokens (or at the end of sequence).",
        ),
    ] = 32,
    device: Device = "auto",
    dtype: Dtype = "auto",
    kernels: Kernels = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Continue --prompt greedily with a quantized MODEL.

    A smoke test that the checkpoint runs on llmq's kernels: prints the text, then the decode
    speed. See docs/kernels.md.
    """
    quiet_libraries()
    from llmq import api

    with cli_errors():
        result = api.generate(
            model,
            prompt,
            max_new_tokens=max_new_tokens,
            device=None if device == "auto" else device,
            dtype=dtype,
            kernels=kernels,
        )
    if json_out:
        print_json(asdict(result))
        return
    out_console.print(Text(result.prompt) + Text(result.text, style="bold"), soft_wrap=True)
    err_console.print(
        f"{result.new_tokens} tokens on {result.device} ({result.kernels} kernels); prefill "
        f"{result.prefill_seconds:.2f} s, decode {result.decode_tokens_per_second:.1f} tokens/s"
    )
