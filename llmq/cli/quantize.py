"""`llmq quantize`: a checkpoint in, a compressed-tensors checkpoint out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmq.cli.console import (
    cli_errors,
    print_json,
    progress_bars,
    quiet_libraries,
    resume_hint_on_interrupt,
    speaks_for_all,
)
from llmq.cli.options import (
    CALIBRATION,
    METHOD,
    OUTPUT,
    SCHEME,
    CalibStatsPath,
    CalibText,
    DampeningFrac,
    Device,
    Ignore,
    JsonFlag,
    ModelArg,
    MoeCalibration,
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
    StageActivations,
    Tf32,
    TrueSequential,
    defaults,
    fraction,
    from_flags,
    given,
    names,
)
from llmq.cli.quantize_report import render, render_gguf
from llmq.config import RESUME_EVERY_S, QuantizeOptions, scheme_names

Q = defaults(QuantizeOptions)

ACTIVATIONS = "Activations"


def _alpha(value: str) -> str:
    """--smooth: auto, none, or an alpha, also as a percentage (50% is 0.5)."""
    return str(fraction("--smooth")(value)) if value.strip().endswith("%") else value


def quantize(
    model: ModelArg,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output folder (compressed-tensors), or file with --format gguf; must not exist "
            "unless --overwrite.",
            rich_help_panel=OUTPUT,
        ),
    ],
    scheme: Annotated[
        str,
        typer.Option(
            metavar="NAME", help=f"Preset: {', '.join(scheme_names())}.", rich_help_panel=SCHEME
        ),
    ] = Q["scheme"],
    method: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="rtn, gptq, awq or awq+gptq; to prune too: magnitude, wanda or sparsegpt.",
            rich_help_panel=METHOD,
        ),
    ] = Q["method"],
    group_size: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Override the scheme's group size: -1 (per channel) or a power of two >= 16.",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    strict_group_size: Annotated[
        bool,
        typer.Option(
            "--strict-group-size",
            help="Refuse, before any work, a group size that does not divide every layer.",
            rich_help_panel=SCHEME,
        ),
    ] = False,
    ignore: Ignore = None,
    clip: Annotated[
        str | None,
        typer.Option(
            metavar="MODE",
            help="Group range: none (min/max), mse or output (least weight or output error).",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    dampening_frac: DampeningFrac = Q["dampening_frac"],
    actorder: Annotated[
        str,
        typer.Option(
            metavar="ORDER",
            help="gptq column order: static (largest Hessian diagonal first) or none (in order).",
            rich_help_panel=METHOD,
        ),
    ] = Q["actorder"],
    true_sequential: TrueSequential = Q["true_sequential"],
    block_size: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="gptq, sparsegpt: columns solved together before the rest are updated.",
            rich_help_panel=METHOD,
        ),
    ] = Q["block_size"],
    awq_grid: Annotated[
        int,
        typer.Option(
            metavar="N", help="awq: scale exponents tried in [0, 1].", rich_help_panel=METHOD
        ),
    ] = Q["awq_grid"],
    awq_duo_scaling: Annotated[
        bool,
        typer.Option(
            help="awq: scales from activation and weight magnitudes (off: activations alone).",
            rich_help_panel=METHOD,
        ),
    ] = Q["awq_duo_scaling"],
    smooth: Annotated[
        str,
        typer.Option(
            metavar="ALPHA",
            parser=_alpha,
            help="SmoothQuant: move this share (0.5 or 50%) of the activation outliers into the "
            "weights; auto or none.",
            rich_help_panel=ACTIVATIONS,
        ),
    ] = "none",
    activations: Annotated[
        str,
        typer.Option(
            metavar="MODE",
            help="Activation scales: dynamic (per token, at run time) or static (calibrated).",
            rich_help_panel=ACTIVATIONS,
        ),
    ] = Q["activations"],
    observer: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="--activations static: range by absmax, percentile (99.99th of |x|) or mse.",
            rich_help_panel=ACTIVATIONS,
        ),
    ] = Q["observer"],
    kv_cache: Annotated[
        str,
        typer.Option(
            metavar="TYPE",
            help="Quantize the KV cache to fp8 or int8 (a calibrated scale per layer), or none.",
            rich_help_panel=ACTIVATIONS,
        ),
    ] = "none",
    sparsity: SparsityOption = None,
    pattern: PatternOption = None,
    sparsity_profile: SparsityProfile = Q["sparsity_profile"],
    calib_text: CalibText = Q["calib_text"],
    num_samples: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Calibration windows: default 1 for plain rtn (the report only), else 128.",
            rich_help_panel=CALIBRATION,
        ),
    ] = None,
    seq_len: SeqLen = Q["seq_len"],
    skip_layer_check: Annotated[
        bool,
        typer.Option(
            "--skip-layer-check",
            help="rtn only: run no forward passes (no per-layer output error); the fastest.",
            rich_help_panel=CALIBRATION,
        ),
    ] = False,
    seed: Seed = Q["seed"],
    moe_calibration: MoeCalibration = Q["moe_calibration"],
    calib_stats: CalibStatsPath = None,
    fallback: Annotated[
        str | None,
        typer.Option(
            metavar="REPORT",
            help="Keep the linears a fallback-scan report flags in full precision; auto: scan now.",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    fallback_threshold: Annotated[
        float | None,
        typer.Option(
            metavar="X",
            parser=fraction("--fallback-threshold"),
            help="--fallback auto: flag above this NRMSE (or error share, with --calib-stats).",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    target_bits: Annotated[
        float | None,
        typer.Option(
            metavar="B",
            help="Mixed precision: choose each linear's scheme for at most B bits a weight.",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    max_size: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Mixed precision: written tensors at most SIZE (95MiB, 2GiB).",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    candidates: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAMES",
            help="Schemes to choose from (default int4-g128,int4-g64,int4-g32,int8,dense).",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    sensitivity: Annotated[
        str,
        typer.Option(
            metavar="MEASURE",
            help="Damage minimized: auto, output, residual, gradient, fisher, weight.",
            rich_help_panel=SCHEME,
        ),
    ] = Q["sensitivity"],
    fisher_windows: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="--sensitivity gradient or fisher: windows read.",
            rich_help_panel=CALIBRATION,
        ),
    ] = Q["fisher_windows"],
    max_ppl_increase: Annotated[
        float | None,
        typer.Option(
            metavar="X",
            parser=fraction("--max-ppl-increase"),
            help="With --target-bits: add --step-bits until perplexity rises at most X.",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    eval_text: Annotated[
        str,
        typer.Option(
            metavar="TEXT",
            help="--max-ppl-increase: held-out text.",
            rich_help_panel=SCHEME,
        ),
    ] = Q["eval_text"],
    eval_windows: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="--max-ppl-increase: windows of 512 tokens.",
            rich_help_panel=SCHEME,
        ),
    ] = Q["eval_windows"],
    step_bits: Annotated[
        float,
        typer.Option(
            metavar="B",
            help="--max-ppl-increase: bits added after a failed try.",
            rich_help_panel=SCHEME,
        ),
    ] = Q["step_bits"],
    overwrite: Overwrite = False,
    resume: Resume = False,
    resume_every: ResumeEvery = RESUME_EVERY_S,
    format: Annotated[
        str,
        typer.Option(
            metavar="FORMAT",
            help="compressed-tensors (a folder for transformers, vLLM) or gguf (a file for "
            "llama.cpp: --scheme q4_k_m (default), q4_k_s, q5_k_m, q5_k_s, q6_k, q8_0, q4_0).",
            rich_help_panel=SCHEME,
        ),
    ] = Q["format"],
    tensor_type: Annotated[
        list[str] | None,
        typer.Option(
            metavar="PATTERN=TYPE",
            help="gguf: TYPE for the tensors the glob matches (repeat; first match wins).",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    imatrix: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="gguf: an importance-matrix file, or none; default: from the calibration text.",
            rich_help_panel=CALIBRATION,
        ),
    ] = None,
    targets: Annotated[
        list[str] | None,
        typer.Option(
            metavar="PATTERN",
            help="Model-free: the modules to quantize (repeat; as --ignore); default: the linears.",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    model_free: Annotated[
        bool | None,
        typer.Option(
            "--model-free/--no-model-free",
            help="Convert without building the model (default when the recipe reads no data).",
            show_default=False,
            rich_help_panel=SCHEME,
        ),
    ] = None,
    require_loader: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAMES",
            help="Refuse a scheme these loaders cannot load: transformers, vllm, llmq (commas "
            "or repeat).",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    space_check: SpaceCheck = True,
    reference: Reference = True,
    device: Device = "auto",
    stage_activations: StageActivations = "auto",
    tf32: Tf32 = True,
    json_out: JsonFlag = False,
) -> None:
    """Quantize MODEL into a compressed-tensors checkpoint.

    transformers and vLLM load the result. One decoder layer at a time is loaded, quantized,
    checked against its float output and written, so memory stays near one layer whatever the
    model size; data-free recipes convert model-free, tensor by tensor. See docs/quantize.md.
    """
    quiet_libraries()
    from llmq import api

    speaks = speaks_for_all()
    with cli_errors():
        lists = {"ignore": tuple(ignore or ()), "require_loaders": tuple(names(require_loader)),
                 "tensor_type": tuple(tensor_type or ()), "targets": tuple(targets or ()),
                 "candidates": tuple(names(candidates)) or Q["candidates"]}  # fmt: skip
        options = from_flags(QuantizeOptions, {**given(QuantizeOptions, locals()), **lists})
        with progress_bars(json_out=json_out) as progress, resume_hint_on_interrupt(out):
            result = api.quantize(
                model, out, options, overwrite=overwrite, resume=resume,
                resume_every_s=resume_every, space_check=space_check, reference=reference,
                progress=progress, device=device,
                stage_activations=stage_activations, tf32=tf32, model_free=model_free,
            )  # fmt: skip
    if not speaks:
        return
    if json_out:
        print_json(result.to_dict())
    elif options.format == "gguf":
        render_gguf(result)
    else:
        render(result)
