"""Options several commands share, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

ModelArg = Annotated[
    str, typer.Argument(help="Checkpoint folder, or a built-in name (`llmq models`).")
]
CalibText = Annotated[
    str,
    typer.Option(
        help="Calibration text: shakespeare, pydoc, news (joined with +), a .txt/.jsonl/.parquet "
        "file, or a dataset in the local HF cache."
    ),
]
Seed = Annotated[int, typer.Option(help="Seed for sampling calibration windows.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
Device = Annotated[
    str,
    typer.Option(help="Where layers run: auto (the GPU when there is one), cpu, cuda or cuda:N."),
]
Dtype = Annotated[
    str,
    typer.Option(
        help="Compute dtype: auto (bfloat16 on a GPU, float32 on the CPU), bfloat16, float16, float32."
    ),
]
Kernels = Annotated[
    str,
    typer.Option(
        help="Quantized linears run: auto (Triton on a GPU, the torch reference on the CPU), "
        "triton (on the CPU only with TRITON_INTERPRET=1), or torch."
    ),
]
SpaceCheck = Annotated[
    bool,
    typer.Option(
        "--space-check/--no-space-check",
        help="Before any work, refuse an output that will not fit in the free space of its file "
        "system. --no-space-check skips this for file systems that report free space wrongly.",
    ),
]
