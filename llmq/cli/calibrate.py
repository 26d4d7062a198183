"""`llmq calibrate`: collect per-linear input statistics once, reuse them in many recipes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmq.cli.console import (
    cli_errors,
    counted,
    out_console,
    print_json,
    progress_bars,
    quiet_libraries,
)
from llmq.cli.options import (
    CALIBRATION,
    OUTPUT,
    CalibText,
    Device,
    JsonFlag,
    ModelArg,
    Seed,
    SpaceCheck,
)
from llmq.texts import DEFAULT_CALIBRATION_TEXT


def calibrate(
    model: ModelArg,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            metavar="FILE",
            help="Statistics file to write (.safetensors).",
            rich_help_panel=OUTPUT,
        ),
    ],
    calib_text: CalibText = DEFAULT_CALIBRATION_TEXT,
    num_samples: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Calibration windows.",
            rich_help_panel=CALIBRATION,
        ),
    ] = 128,
    seq_len: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Tokens per window.",
            rich_help_panel=CALIBRATION,
        ),
    ] = 512,
    seed: Seed = 0,
    hessian: Annotated[
        bool,
        typer.Option(
            "--hessian",
            help="Also collect each input's Hessian XᵀX, [in, in] float32 (for gptq).",
            rich_help_panel=CALIBRATION,
        ),
    ] = False,
    imatrix: Annotated[
        bool,
        typer.Option(
            "--imatrix",
            help="Write llama.cpp's importance matrix instead (mean squared inputs; OUT.imatrix), "
            "for quantize --format gguf --imatrix and llama-quantize --imatrix.",
            rich_help_panel=CALIBRATION,
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace an existing statistics file.",
            rich_help_panel=OUTPUT,
        ),
    ] = False,
    space_check: SpaceCheck = True,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Collect every linear's input statistics, for reuse.

    Per-channel absmax and mean |x| of every linear's input (with --hessian also XᵀX), saved
    for llmq quantize --calib-stats and llmq fallback-scan --calib-stats. See docs/quantize.md.
    """
    quiet_libraries()
    from llmq import api

    with cli_errors(), progress_bars(json_out=json_out) as progress:
        result = api.calibrate(
            model, out, calib_text=calib_text, num_samples=num_samples, seq_len=seq_len,
            seed=seed, hessian=hessian, imatrix=imatrix, overwrite=overwrite,
            space_check=space_check,
            progress=progress, device=device,
        )  # fmt: skip
    if json_out:
        print_json(result.to_dict())
    else:
        out_console.print(
            f"wrote {result.out}: statistics of {counted(result.linears, 'linear')} from "
            f"{result.calibration['tokens']} tokens of {result.calibration['text']} "
            f"(seed {seed}) in {result.seconds:.1f} s"
        )
