"""`llmq quantize`: a checkpoint in, a compressed-tensors checkpoint out."""

from __future__ import annotations

from collections import Counter
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
    resume_hint_on_interrupt,
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
    TrueSequential,
    defaults,
    fraction,
    from_flags,
    given,
    names,
)
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
            help="Output folder (compressed-tensors); must not exist unless --overwrite.",
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
    overwrite: Overwrite = False,
    resume: Resume = False,
    resume_every: ResumeEvery = RESUME_EVERY_S,
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
    json_out: JsonFlag = False,
) -> None:
    """Quantize MODEL into a compressed-tensors checkpoint.

    transformers and vLLM load the result. One decoder layer at a time is loaded, quantized,
    checked against its float output and written, so memory stays near one layer whatever the
    model size. See docs/quantize.md for the schemes, methods and every option.
    """
    quiet_libraries()
    from llmq import api

    with cli_errors():
        lists = {"ignore": tuple(ignore or ()), "require_loaders": tuple(names(require_loader))}
        options = from_flags(QuantizeOptions, {**given(QuantizeOptions, locals()), **lists})
        with progress_bars(json_out=json_out) as progress, resume_hint_on_interrupt(out):
            result = api.quantize(
                model, out, options, overwrite=overwrite, resume=resume,
                resume_every_s=resume_every, space_check=space_check, reference=reference,
                progress=progress, device=device,
            )  # fmt: skip
    if json_out:
        print_json(result.to_dict())
    else:
        render(result)


def render(result: Any) -> None:
    compare = any(layer.rtn_output_rel_rmse is not None for layer in result.layers)
    baseline = "magnitude" if result.scheme == "DENSE" else "RTN"  # pruning alone, quantizing
    pruning_only = result.scheme == "DENSE"
    what = f"{result.method} pruning" if pruning_only else f"{result.scheme} ({result.method})"
    table = Table(title=f"{what} per-layer report")
    table.add_column("layer", justify="right")
    table.add_column("output rel. RMSE", justify="right")
    if compare:
        table.add_column(f"with {baseline}", justify="right")
        table.add_column(f"worst linear: output error ({baseline})")
    else:
        table.add_column("worst linear (weight NRMSE)")
    pruned = result.sparsity is not None
    if pruned:
        table.add_column("sparsity", justify="right")
    table.add_column("seconds", justify="right")
    for layer in result.layers:
        cells = [str(layer.index), _number(layer.output_rel_rmse)]
        if compare:
            cells += [_number(layer.rtn_output_rel_rmse), _worst_output(layer.linears)]
        else:
            cells.append(_worst_weight(layer.linears))
        if pruned:
            zeros = sum(linear.sparsity * linear.numel for linear in layer.linears)
            cells.append(f"{zeros / max(sum(linear.numel for linear in layer.linears), 1):.1%}")
        table.add_row(*cells, f"{layer.seconds:.1f}")
    out_console.print(table)
    for layer in result.layers:
        for linear in layer.linears:
            if linear.warning:
                out_console.print(f"warning: {linear.name}: {linear.warning}")
    adjusted = Counter(
        (a["requested"], a["used"], a["in_features"]) for a in result.group_size_adjustments
    )
    for (requested, used, in_features), count in sorted(adjusted.items(), key=str):
        used_text = "per-channel" if used is None else f"{used}"
        out_console.print(
            f"group size (block width) {requested} does not divide in_features {in_features}: "
            f"{counted(count, 'linear')} use {used_text} (own config group)"
        )
    _print_scaling(result.layers)
    _print_expert_coverage(result.layers)
    if result.fallback:
        kept = result.fallback["kept"]
        out_console.print(
            f"fallback ({result.fallback['report']}, {result.fallback['scheme']}): kept "
            f"{counted(len(kept), 'flagged linear')} in full precision{': ' if kept else ''}"
            + ", ".join(kept)
        )
    if result.resumed_layers:
        out_console.print(f"resumed after {counted(result.resumed_layers, 'finished layer')}")
    _print_sparsity(result)
    if result.scheme != "DENSE":  # a pruned checkpoint is plain: every loader but llmq's reads it
        _print_loaders(result)
    sizes = result.size_bytes
    kept = "left unpruned" if result.scheme == "DENSE" else "kept in full precision"
    out_console.print(
        f"wrote {result.out_dir} ({sizes['output'] / 1e6:.1f} MB, source {sizes['source'] / 1e6:.1f} MB) "
        f"in {result.seconds:.1f} s; {kept}: {counted(len(result.ignored), 'linear')}"
    )


def _print_sparsity(result: Any) -> None:
    """Pruning methods: the share of zeros in the linears, as written."""
    if result.sparsity is None:
        return
    which = "pruned" if result.scheme == "DENSE" else "quantized"
    shares = result.sparsity
    out_console.print(
        f"sparsity of the {which} linears, as written: {shares['linears']:.2%} "
        f"(per linear {shares['min']:.2%} to {shares['max']:.2%})"
    )


def _print_loaders(result: Any) -> None:
    """Which loaders read the checkpoint, and for the others why not and what to use."""
    readers = [name for name, support in result.loaders.items() if support["reads"]]
    for name, support in result.loaders.items():
        if not support["reads"]:
            out_console.print(
                labelled("note:", "bold yellow", f"plain {name} cannot load this checkpoint: "
                f"{support['why']}; load it with {' or '.join(readers)} "
                "(llmq.load_quantized), and check it with `llmq verify`"),
                soft_wrap=True,
            )  # fmt: skip


def _print_scaling(layers: list[Any]) -> None:
    """One line on the AWQ / SmoothQuant folds: how many pairings were scaled, with which
    alphas, and the median change of their output error on the calibration data."""
    reports = [scale for layer in layers for scale in layer.scales]
    if not reports:
        return
    scaled = [r for r in reports if r.alpha is not None]
    alphas = Counter(r.alpha for r in scaled)
    reductions = sorted(r.error_reduction for r in reports)
    out_console.print(
        f"equivalence scaling: {len(scaled)} of {counted(len(reports), 'norm/linear pairing')} scaled "
        f"(alpha: {', '.join(f'{a:g} x{n}' for a, n in sorted(alphas.items()))}); median "
        f"output error reduction {reductions[len(reductions) // 2]:.1%}"
    )


def _print_expert_coverage(layers: list[Any]) -> None:
    """Mixtures of experts: the calibration tokens routed to each expert, their range over the
    model, and every expert routed too few of them."""
    counts = [n for layer in layers for n in layer.expert_tokens or []]
    if not counts:
        return
    from llmq.pipeline.report import STARVED_SHARE, starved_experts  # torch: not for --help

    starved = starved_experts(layers)
    out_console.print(
        f"experts: {min(counts)} to {max(counts)} calibration tokens routed to each; "
        f"{counted(len(starved), 'expert')} under {STARVED_SHARE:.0%} of an even share"
    )
    for index, expert, tokens in starved:
        out_console.print(
            f"warning: layer {index} expert {expert}: {counted(tokens, 'token')} routed"
        )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _worst_weight(linears: list[Any]) -> str:
    worst = max(linears, key=lambda linear: linear.weight_nrmse, default=None)
    return "-" if worst is None else f"{_short(worst.name)} {worst.weight_nrmse:.4f}"


def _worst_output(linears: list[Any]) -> str:
    measured = [linear for linear in linears if linear.output_error is not None]
    worst = max(measured, key=lambda linear: linear.output_error, default=None)
    if worst is None:
        return "-"
    return f"{_short(worst.name)} {worst.output_error:.4f} ({_number(worst.rtn_output_error)})"
