"""`llmq prune`: a checkpoint in, the same checkpoint with pruned weights out (plain, dense
safetensors that every loader reads). The layer pipeline of `quantize`, without quantization."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from llmq.cli.console import (
    cli_errors,
    out_console,
    print_json,
    progress_bars,
    quiet_libraries,
    resume_hint_on_interrupt,
)
from llmq.cli.options import (
    CALIBRATION,
    METHOD,
    OUTPUT,
    PRUNING,
    CalibStatsPath,
    CalibText,
    DampeningFrac,
    Device,
    JsonFlag,
    ModelArg,
    MoeCalibration,
    Overwrite,
    PatternOption,
    PruneIgnore,
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
    explicit,
    fraction,
    from_flags,
    given,
)
from llmq.cli.quantize_report import render
from llmq.config import RESUME_EVERY_S, CalibrationOptions, PruneOptions, StructuredOptions
from llmq.errors import InputError

P = defaults(PruneOptions)
S = defaults(StructuredOptions)

STRUCTURED = "Structured pruning"


def prune(
    ctx: typer.Context,
    model: ModelArg,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output folder (a plain checkpoint); must not exist unless --overwrite.",
            rich_help_panel=OUTPUT,
        ),
    ],
    method: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="sparsegpt (updates the weights kept), wanda (by |w|·‖x‖) or magnitude (by |w|).",
            rich_help_panel=METHOD,
        ),
    ] = P["method"],
    sparsity: SparsityOption = None,
    pattern: PatternOption = None,
    sparsity_profile: SparsityProfile = P["sparsity_profile"],
    structured: Annotated[
        bool,
        typer.Option(
            "--structured",
            help="Remove whole channels, heads and layers instead: a smaller dense model.",
            rich_help_panel=STRUCTURED,
        ),
    ] = False,
    params: Annotated[
        float | None,
        typer.Option(
            help="Keep this share of all the parameters (0.75 or 75%) by narrowing the MLP.",
            metavar="X",
            parser=fraction("--params"),
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    decoder_params: Annotated[
        float | None,
        typer.Option(
            help="As --params, a share of the decoder layers' parameters alone.",
            metavar="X",
            parser=fraction("--decoder-params"),
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    intermediate_size: Annotated[
        int | None,
        typer.Option(
            metavar="N", help="MLP channels to keep in every layer.", rich_help_panel=STRUCTURED
        ),
    ] = None,
    num_kv_heads: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Key-value groups to keep in every layer, each with its query heads.",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    num_layers: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Decoder layers to keep, the most important (see --depth-metric).",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    num_heads: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Query heads to keep, the same number in every key-value group kept.",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    hidden_size: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Hidden (embedding) channels to keep, everywhere; the hardest cut on quality.",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    depth_metric: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="Rank layers by block (1 - cos of input and output) or ppl (slower).",
            rich_help_panel=STRUCTURED,
        ),
    ] = S["depth_metric"],
    importance: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Reuse the scores saved by --save-importance (no scoring pass).",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    save_importance: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Save the importance scores to this .safetensors file.",
            rich_help_panel=STRUCTURED,
        ),
    ] = None,
    evaluate: Annotated[
        bool,
        typer.Option(
            help="Report held-out perplexity of the source and the result.",
            rich_help_panel=STRUCTURED,
        ),
    ] = S["evaluate"],
    sparse_format: Annotated[
        str,
        typer.Option(
            metavar="FORMAT",
            help="dense: plain safetensors that load everywhere (bitmask is refused).",
            rich_help_panel=PRUNING,
        ),
    ] = P["sparse_format"],
    ignore: PruneIgnore = None,
    calib_text: CalibText = P["calib_text"],
    num_samples: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Calibration windows: default 128, or 1 for magnitude (the report only).",
            rich_help_panel=CALIBRATION,
        ),
    ] = None,
    seq_len: SeqLen = P["seq_len"],
    skip_layer_check: Annotated[
        bool,
        typer.Option(
            "--skip-layer-check",
            help="magnitude only: run no forward passes (no per-layer output error).",
            rich_help_panel=CALIBRATION,
        ),
    ] = False,
    seed: Seed = P["seed"],
    moe_calibration: MoeCalibration = P["moe_calibration"],
    calib_stats: CalibStatsPath = None,
    dampening_frac: DampeningFrac = P["dampening_frac"],
    true_sequential: TrueSequential = P["true_sequential"],
    overwrite: Overwrite = False,
    resume: Resume = False,
    resume_every: ResumeEvery = RESUME_EVERY_S,
    space_check: SpaceCheck = True,
    reference: Reference = True,
    device: Device = "auto",
    stage_activations: StageActivations = "auto",
    tf32: Tf32 = True,
    json_out: JsonFlag = False,
) -> None:
    """Prune MODEL and write a plain checkpoint.

    --sparsity or --pattern zero single weights of the decoder linears; --structured removes
    whole MLP channels, key-value groups, hidden channels and layers for a smaller dense model.
    transformers and vLLM load the result; llmq.json records what was removed. One decoder
    layer at a time, as llmq quantize; lm_head and the embeddings are never pruned. To prune
    and quantize in one pass: llmq quantize --method sparsegpt --sparsity 0.5. See
    docs/prune.md for details.
    """
    quiet_libraries()
    from llmq import api

    params = locals()
    run = {"overwrite": overwrite, "space_check": space_check, "reference": reference, "device": device}  # fmt: skip
    with cli_errors():
        _check_mode(structured, explicit(ctx))
        if structured:
            options = from_flags(StructuredOptions, given(StructuredOptions, params))
            with progress_bars(json_out=json_out) as progress:
                result = api.prune_structured(model, out, options, progress=progress, **run)
            print_json(result.to_dict()) if json_out else render_structured(result)
            return
        options = from_flags(
            PruneOptions, {**given(PruneOptions, params), "ignore": tuple(ignore or ())}
        )
        with progress_bars(json_out=json_out) as progress, resume_hint_on_interrupt(out):
            result = api.prune(
                model, out, options, resume=resume, resume_every_s=resume_every,
                progress=progress, stage_activations=stage_activations, tf32=tf32, **run,
            )  # fmt: skip
    if json_out:
        print_json(result.to_dict())
    else:
        render(result)


def _check_mode(structured: bool, explicit: set[str]) -> None:
    """An option of the other kind of pruning is refused, not ignored."""
    shared = set(CalibrationOptions.model_fields)
    if structured:
        other = sorted(explicit & (set(PruneOptions.model_fields) - shared))
        if other:
            raise InputError(f"--{other[0].replace('_', '-')}: prunes single weights; --structured removes whole channels, groups and layers")  # fmt: skip
    else:
        other = sorted(explicit & (set(StructuredOptions.model_fields) - shared))
        if other:
            raise InputError(f"--{other[0].replace('_', '-')}: goes with --structured")


def render_structured(result: Any) -> None:
    table = Table(title=f"structured pruning of {Path(result.model).name}")
    table.add_column("what")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for axis, value in result.removed.items():
        if axis == "layers":
            continue
        table.add_row(axis, str(value[0]), str(value[1]))
    for label, counts in (("parameters", result.parameters), ("  decoder layers", result.decoder_parameters)):  # fmt: skip
        share = counts["output"] / counts["source"]
        table.add_row(label, f"{counts['source'] / 1e6:.1f} M", f"{counts['output'] / 1e6:.1f} M ({share:.1%})")  # fmt: skip
    sizes = result.size_bytes
    table.add_row("file size", f"{sizes['source'] / 1e6:.1f} MB", f"{sizes['output'] / 1e6:.1f} MB")
    if result.perplexity:
        ppl = result.perplexity
        table.add_row(
            "perplexity", f"{ppl['source']:.3f}", f"{ppl['output']:.3f} ({ppl['increase']:+.1%})"
        )
    out_console.print(table)
    if result.removed["layers"]:
        out_console.print(f"layers removed: {', '.join(map(str, result.removed['layers']))}")
    if result.perplexity:
        p = result.perplexity["protocol"]
        out_console.print(
            f"perplexity protocol: {p['text']}, {p['windows']} x {p['seq_len']} tokens, BOS {'yes' if p['bos'] else 'no'}, {p['dtype']}"
        )
    out_console.print(
        f"wrote {result.out_dir} in {result.seconds:.1f} s (importance: {result.importance})"
    )
