"""`llmq prune`: a checkpoint in, the same checkpoint with pruned weights out (plain, dense
safetensors that every loader reads). The layer pipeline of `quantize`, without quantization."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmq.cli.console import cli_errors, err_console, print_json, progress_bars, quiet_libraries
from llmq.cli.options import (
    CalibStatsPath,
    CalibText,
    DampeningFrac,
    Device,
    Ignore,
    JsonFlag,
    ModelArg,
    Overwrite,
    PatternOption,
    Reference,
    Resume,
    ResumeEvery,
    Seed,
    SeqLen,
    SpaceCheck,
    SparsityOption,
    SparsityProfile,
    TrueSequential,
)
from llmq.cli.quantize import render
from llmq.config import RESUME_EVERY_S
from llmq.texts import DEFAULT_CALIBRATION_TEXT


def prune(
    model: ModelArg,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output folder (a plain Hugging Face checkpoint); must not exist unless --overwrite.",
        ),
    ],
    method: Annotated[
        str,
        typer.Option(
            help="sparsegpt: GPTQ's solver chooses each block's mask from the updated weights and spreads each pruned weight over the inputs not yet visited, using each input's Hessian. wanda: drop the smallest |w|·‖x‖ in each row (no weight update). magnitude: drop the smallest |w| (no data needed)."
        ),
    ] = "sparsegpt",
    sparsity: SparsityOption = None,
    pattern: PatternOption = None,
    sparsity_profile: SparsityProfile = "uniform",
    sparse_format: Annotated[
        str,
        typer.Option(
            help="dense: the pruned weights as plain safetensors (loads everywhere). bitmask (compressed-tensors' sparse-bitmask) is refused: compressed-tensors 0.15+ cannot write it and transformers silently re-initialises such weights."
        ),
    ] = "dense",
    ignore: Ignore = None,
    calib_text: CalibText = DEFAULT_CALIBRATION_TEXT,
    num_samples: Annotated[
        int | None,
        typer.Option(
            help="Calibration windows. Default 128 (wanda, sparsegpt); 1 for magnitude (it needs no data: the window feeds only the per-layer output-error report)."
        ),
    ] = None,
    seq_len: SeqLen = 512,
    skip_layer_check: Annotated[
        bool,
        typer.Option(
            help="magnitude only: run no forward passes (no per-layer output error; the weights are still checked for NaN/Inf)."
        ),
    ] = False,
    seed: Seed = 0,
    calib_stats: CalibStatsPath = None,
    dampening_frac: DampeningFrac = 0.01,
    true_sequential: TrueSequential = True,
    overwrite: Overwrite = False,
    resume: Resume = False,
    resume_every: ResumeEvery = RESUME_EVERY_S,
    space_check: SpaceCheck = True,
    reference: Reference = True,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Prune MODEL's decoder linears (--sparsity or --pattern) and write a plain checkpoint
    that transformers and vLLM load; llmq.json records the sparsity.

    One decoder layer at a time, as `llmq quantize`: each layer sees the already-pruned
    layers' outputs, and the report compares it with the dense layer and with magnitude
    pruning. lm_head and the embeddings are never pruned. To prune and quantize in one pass,
    use `llmq quantize --method sparsegpt --sparsity 0.5`.
    """
    quiet_libraries()
    from llmq import api
    from llmq.api.quantize import check_sparse_format

    with cli_errors():
        check_sparse_format(sparse_format)  # before any work
        recipe = api.make_recipe(
            scheme="dense", method=method, ignore=("lm_head", *(ignore or [])),
            calib_text=calib_text, num_samples=num_samples, seq_len=seq_len, seed=seed,
            skip_layer_check=skip_layer_check, dampening_frac=dampening_frac, actorder="none",
            true_sequential=true_sequential, sparsity=sparsity, pattern=pattern,
            sparsity_profile=sparsity_profile,
        )  # fmt: skip
        with progress_bars(json_out=json_out) as progress:
            try:
                result = api.quantize(
                    model, out, recipe=recipe, calib_stats=calib_stats, overwrite=overwrite,
                    resume=resume, resume_every_s=resume_every, space_check=space_check,
                    reference=reference, progress=progress, device=device,
                )  # fmt: skip
            except KeyboardInterrupt:
                err_console.print(f"partial output kept; continue with: --out {out} --resume")
                raise
    if json_out:
        print_json(result.to_dict())
    else:
        render(result)
