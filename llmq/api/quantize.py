"""`quantize`: a recipe, planned, run through the layer pipeline into a checkpoint."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

from llmq import __version__
from llmq.api.common import (
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_REPORT_SAMPLES,
    _calibration_windows,
    _open,
)
from llmq.api.scan import _input_weights
from llmq.config import (
    PRUNING_METHODS,
    RESUME_EVERY_S,
    SCAN_SHARE_THRESHOLD,
    CalibConfig,
    Recipe,
    build,
    get_scheme,
    parse_smooth,
)
from llmq.errors import InputError
from llmq.progress import NO_PROGRESS, Progress
from llmq.texts import DEFAULT_CALIBRATION_TEXT, text_inputs


def make_recipe(
    *,
    scheme: str = "w4a16",
    method: str = "rtn",
    group_size: int | None = None,
    strict_group_size: bool = False,
    ignore: tuple[str, ...] | list[str] = ("lm_head",),
    clip: str | None = None,
    calib_text: str = DEFAULT_CALIBRATION_TEXT,
    num_samples: int | None = None,
    seq_len: int = 512,
    seed: int = 0,
    skip_layer_check: bool = False,
    dampening_frac: float = 0.01,
    actorder: str = "static",
    block_size: int = 128,
    true_sequential: bool = True,
    awq_grid: int = 20,
    awq_duo_scaling: bool = True,
    smooth: str | float | None = None,
    activations: str = "dynamic",
    observer: str = "absmax",
    kv_cache: str | None = None,
    sparsity: float | None = None,
    pattern: str | None = None,
    sparsity_profile: str = "uniform",
) -> Recipe:
    """Validate options into a Recipe (InputError naming the option on bad values).

    GPTQ: dampening_frac, actorder ("static" or "none"), block_size, true_sequential (group by
    group inside each layer, in one forward pass; off: the float layer observed whole, in two
    passes and with fewer activations held). AWQ: awq_grid alphas,
    awq_duo_scaling (s = mean|x|^a / mean|w|^(1-a); off: mean|x|^a). SmoothQuant: smooth
    (alpha in [0, 1], "auto" or None). activations: "dynamic" (per token) or "static" (one
    calibrated input_scale per linear, chosen by observer: absmax, percentile or mse).
    kv_cache: "fp8" or "int8" (calibrated k_scale / v_scale per layer), or None.
    Pruning methods (magnitude, wanda, sparsegpt): `sparsity` (share of each row's weights
    removed) or `pattern` ("2:4"); the pruned weights are quantized to exactly zero.
    sparsity_profile: "uniform", "owl" (layers with more outliers keep more weights) or "scan"
    (layers whose pruning costs a larger share of their output keep more weights); the same
    total, measured on the dense model in one more calibration pass.
    """
    from llmq.quant.methods import get_method, method_names

    if method not in method_names():  # first: the other checks read the method
        raise InputError(f"unknown method {method!r}", hint=f"choose one of: {', '.join(method_names())}")  # fmt: skip
    if actorder in ("group", "dynamic"):
        raise InputError(
            f"--actorder {actorder}: compressed-tensors removed weight_g_idx checkpoints, so "
            "transformers and vLLM with current compressed-tensors cannot load them",
            hint="--actorder static orders columns by activation too and keeps groups contiguous",
        )
    preset = get_scheme(scheme)
    data_free = method in ("rtn", "magnitude")
    if skip_layer_check and not data_free:
        raise InputError(
            f"--skip-layer-check: {method} needs calibration data",
            hint="only rtn and magnitude can skip it",
        )
    clip = preset.clip_for(method) if clip is None else clip
    if clip == "output" and skip_layer_check:
        raise InputError("--clip output weighs errors by calibration data; drop --skip-layer-check")

    if num_samples is None:  # data-free rtn needs windows only for the report
        calibrated = (
            not data_free
            or activations == "static"
            or any(option not in (None, "none") for option in (smooth, kv_cache))
        )
        num_samples = DEFAULT_CALIB_SAMPLES if calibrated else DEFAULT_REPORT_SAMPLES
    if num_samples < 1:
        raise InputError(f"--num-samples {num_samples}: must be >= 1")
    calibration = None
    if not skip_layer_check:
        calibration = build(
            CalibConfig, text=calib_text, num_samples=num_samples, seq_len=seq_len, seed=seed
        )
    recipe = build(
        Recipe,
        scheme=preset,
        method=method,
        group_size=group_size,
        strict_group_size=strict_group_size,
        ignore=tuple(ignore),
        clip=clip,
        calibration=calibration,
        gptq={
            "dampening_frac": dampening_frac,
            "actorder": actorder,
            "block_size": block_size,
            "true_sequential": true_sequential,
        },
        awq={"grid": awq_grid, "duo_scaling": awq_duo_scaling},
        smooth=parse_smooth(smooth),
        activations=activations,
        observer=observer,
        kv_cache=None if kv_cache in (None, "none") else kv_cache,
        sparsity=sparsity,
        pattern=pattern,
        sparsity_profile=sparsity_profile,
    )
    assert isinstance(recipe, Recipe)
    get_method(recipe)  # an unknown method fails here, before any work
    return recipe


def quantize(
    model: str | Path,
    out: str | Path,
    *,
    recipe: Recipe | None = None,
    calib_stats: str | Path | None = None,
    fallback: str | Path | None = None,
    fallback_threshold: float | None = None,
    overwrite: bool = False,
    resume: bool = False,
    resume_every_s: float = RESUME_EVERY_S,
    space_check: bool = True,
    require_loaders: tuple[str, ...] | list[str] = (),
    reference: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    **options: Any,
) -> Any:
    """Quantize MODEL (a folder or built-in name) into a compressed-tensors checkpoint at OUT.

    Options are those of `make_recipe` (scheme, method, group_size, ignore, clip, calib_text,
    num_samples, seq_len, seed); or pass a ready `recipe`. `device`: where each layer runs
    (default: the GPU when there is one). `fallback`: a `fallback_scan` JSON report, or "auto"
    to scan now with the recipe's weight arguments (`fallback_threshold`: the NRMSE threshold,
    default the scheme's; with `calib_stats`, the output error share threshold, default 0.05);
    the linears it flags stay in full precision and join the checkpoint's `ignore` list.
    `resume_every_s`: seconds between the resume points an interrupted run continues from with
    `resume=True` (0: after every layer). One run at a time writes OUT (a second one raises
    InputError naming the first); `space_check=False` skips the refusal, before any work, of an
    output that will not fit on OUT's file system. `require_loaders` (transformers, vllm, llmq):
    refuse, before any work, a scheme one of them cannot load. `reference`: record in llmq.json
    what the written files compute on a few prompts, for `verify` (one more pass over the
    written layers; file hashes are recorded either way). Returns a `QuantizeResult`.
    """
    from llmq.calib.stats import CalibStats
    from llmq.io.atomic import (
        check_free_space,
        check_output_dir,
        claim_output,
        refuse_inputs,
        staging_path,
    )
    from llmq.pack.format import scheme_format
    from llmq.pack.loaders import check_required_loaders
    from llmq.pipeline.plan import disk_needed, plan_quantization
    from llmq.pipeline.quantize import run_quantization
    from llmq.pipeline.state import keep_if_resumable

    recipe = recipe or make_recipe(**options)
    loaders = check_required_loaders(recipe.weight_args, scheme_format(recipe.scheme), require_loaders)  # fmt: skip
    if not resume_every_s >= 0:
        raise InputError(f"--resume-every {resume_every_s}: must be >= 0 seconds")
    ckpt = _open(model, progress)
    out = Path(out)
    inputs = [("model", ckpt.path), ("statistics file", calib_stats), *_fallback_input(fallback)]
    if recipe.calibration is not None:
        inputs += text_inputs(recipe.calibration.text, "calibration text")
    refuse_inputs(out, inputs)  # before the fallback scan, the first work
    if fallback_threshold is not None and str(fallback) != "auto":
        raise InputError(
            "--fallback-threshold sets the inline scan's threshold: use --fallback auto"
        )
    fallback_record = None
    if fallback is not None and recipe.weight_args is None:
        raise InputError("--fallback keeps linears out of quantization; pruning alone has none")
    if fallback is not None:
        weights = _input_weights(Path(calib_stats)) if calib_stats and str(fallback) == "auto" else None  # fmt: skip
        recipe, fallback_record = _apply_fallback(
            ckpt, recipe, fallback, fallback_threshold, weights, progress
        )
    plan = plan_quantization(ckpt, recipe)
    _check_pairings(ckpt, recipe)
    stats = CalibStats.load(Path(calib_stats)) if calib_stats else None
    staging = staging_path(out)
    kept = partial(keep_if_resumable, staging, "rerun the same command with --resume to continue")
    with claim_output(out, inputs=inputs, kept=kept):  # held until the output is published
        check_output_dir(out, overwrite=overwrite)
        if space_check:
            check_free_space(out, disk_needed(ckpt, plan, recipe, staging if resume else None))
        record: dict[str, Any] = {
            "llmq_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source_model": str(model),
            "recipe": recipe.model_dump(mode="json"),
            "calibration": None,
            "loaders": loaders,
        }
        ids = None
        if recipe.calibration is not None:
            cal = recipe.calibration
            windows = _calibration_windows(ckpt.path, cal, progress)
            ids = windows.input_ids
            record["calibration"] = {
                **cal.model_dump(),
                "tokens": windows.num_tokens,
                "bos": windows.add_bos,
            }
        if stats is not None:
            record["calib_stats"] = {"file": str(calib_stats), **stats.metadata}
        if fallback_record is not None:
            record["fallback"] = fallback_record
        sparsities = None
        if recipe.sparsity_profile != "uniform":
            sparsities = _layer_profile(ckpt, plan, recipe, ids, progress, device)
            record["sparsity_profile"] = sparsities
        return run_quantization(
            ckpt, plan, recipe, out,
            calibration_ids=ids, calib_stats=stats, resume=resume, progress=progress,
            record=record, device=device, resume_every_s=resume_every_s, reference=reference,
            layer_sparsities=None if sparsities is None else sparsities["sparsity"],
        )  # fmt: skip


def _layer_profile(
    ckpt: Any, plan: Any, recipe: Recipe, ids: Any, progress: Progress, device: str | None
) -> dict[str, Any]:
    """The per-layer sparsities of the recipe's profile and the measure they come from, taken
    on the dense model's activations (one calibration pass: `collect_stats` with sums of
    squares): OWL's outlier ratios, or the scan's relative pruning errors."""
    from llmq.calib.collect import collect_stats
    from llmq.pruning.profile import owl_sparsities, scan_sparsities

    assert recipe.sparsity is not None and ids is not None  # the recipe requires both
    stats = collect_stats(ckpt, ids, norms=True, progress=progress, device=device)
    layers = [[linear.name for linear in linears] for linears in plan.layers]
    if recipe.sparsity_profile == "owl":
        sparsity, ratios = owl_sparsities(ckpt, stats, layers, recipe.sparsity)
        return {"profile": "owl", "sparsity": sparsity, "outlier_ratio": ratios}
    sparsity, relative, shares = scan_sparsities(ckpt, stats, layers, recipe.sparsity, recipe.method)  # fmt: skip
    return {"profile": "scan", "sparsity": sparsity, "relative_error": relative, "error_share": shares}  # fmt: skip


def _fallback_input(fallback: str | Path | None) -> list[tuple[str, Path]]:
    """The fallback report a run reads, as an input no output may cover."""
    return [] if fallback is None or str(fallback) == "auto" else [("fallback report", Path(fallback))]  # fmt: skip


def _apply_fallback(
    ckpt: Any,
    recipe: Recipe,
    fallback: str | Path,
    threshold: float | None,
    input_weights: dict[str, Any] | None,
    progress: Progress,
) -> tuple[Recipe, dict[str, Any]]:
    """The recipe with the linears a scan flags added to `ignore`, and what was kept and why."""
    from llmq.fallback.report import ScanReport
    from llmq.fallback.scan import ScanOptions
    from llmq.fallback.scan import fallback_scan as scan

    if str(fallback) == "auto":
        calibrated = input_weights is not None  # the threshold is then the error share's
        options = ScanOptions(
            scheme=recipe.scheme.name.lower(), args=recipe.weight_args, workers=2,
            input_weights=input_weights,
            nrmse_threshold=None if calibrated else threshold,
            share_threshold=threshold if calibrated and threshold else SCAN_SHARE_THRESHOLD,
        )  # fmt: skip
        report = scan(ckpt.path, options, progress=progress)
    else:
        report = ScanReport.load(Path(fallback))
    modules = report.flagged_modules()
    unknown = [m for m in modules if not ckpt.has(f"{m}.weight")]
    if unknown:
        raise InputError(
            f"{fallback}: the report flags tensors {ckpt.path} does not have "
            f"({unknown[0]}.weight and {len(unknown) - 1} more)",
            hint=f"scan this checkpoint: llmq fallback-scan {ckpt.path} --report scan.json",
        )
    linears = set(ckpt.decoder_linears)
    kept = [m for m in modules if m in linears]
    record = {
        "report": "auto" if str(fallback) == "auto" else str(fallback),
        "scheme": report.args.label,
        "rule": report.rule,
        "kept": kept,
        "flagged_not_quantized": [m for m in modules if m not in linears],
    }
    return recipe.model_copy(update={"ignore": (*recipe.ignore, *kept)}), record


def _check_pairings(ckpt: Any, recipe: Recipe) -> None:
    """AWQ and SmoothQuant fold scales into the pairings the family table gives (a fixed
    SmoothQuant alpha into fewer of them); refuse when there are none."""
    from llmq.quant.methods import get_method

    layout = ckpt.layout
    pairs = layout.smooth if recipe.smooth is None else layout.smoothing_pairs(recipe.smooth)
    scaled = get_method(recipe).awq is not None or recipe.smooth is not None
    if scaled and not pairs:
        option = f"--method {recipe.method}" if recipe.smooth is None else "--smooth"
        raise InputError(
            f"{option}: llmq has no norm/linear pairings for "
            f"model_type {ckpt.config.get('model_type')!r}",
            hint="use --method gptq or rtn without --smooth, which need none",
        )


SPARSE_FORMAT_REFUSAL = (
    "compressed-tensors 0.15 removed its sparse compressors (0.20 cannot write the format) and "
    "transformers drops a sparsity_config: a plain from_pretrained re-initialises every pruned "
    "linear at random, with only a load-report warning (measured with transformers 5.23, "
    "compressed-tensors 0.20)"
)


def check_pruning_method(method: str) -> None:
    """`prune` takes a pruner; a quantization method or a typo is named as such."""
    if method not in PRUNING_METHODS:
        raise InputError(f"unknown method {method!r} for prune", hint=f"choose one of: {', '.join(PRUNING_METHODS)}")  # fmt: skip


def check_sparse_format(sparse_format: str) -> None:
    """Only "dense" is written; "bitmask" is refused with the reason (SPARSE_FORMAT_REFUSAL)."""
    if sparse_format == "bitmask":
        raise InputError(
            f"--sparse-format bitmask: no current loader reads it back ({SPARSE_FORMAT_REFUSAL})",
            hint="pruned checkpoints are written dense: they load everywhere",
        )
    if sparse_format != "dense":
        raise InputError(f"--sparse-format {sparse_format!r}: choose dense (or bitmask, refused)")


def prune(
    model: str | Path,
    out: str | Path,
    *,
    method: str = "sparsegpt",
    sparse_format: str = "dense",
    **options: Any,
) -> Any:
    """Prune MODEL (a folder or built-in name) into a plain Hugging Face checkpoint at OUT: the
    pruned weights stay in their dtype, so every loader reads it, and llmq.json records the
    sparsity. `method`: magnitude (no data), wanda or sparsegpt, with `sparsity` (the share of
    each row's weights removed) or `pattern` ("2:4"). The same layer pipeline as `quantize`
    and its options (calibration, ignore, resume, space check, reference), except the
    quantization ones. `sparse_format`: only "dense" (why: SPARSE_FORMAT_REFUSAL). Returns a
    `QuantizeResult`."""
    check_sparse_format(sparse_format)
    check_pruning_method(method)
    for option in ("scheme", "group_size", "clip", "fallback", "smooth", "kv_cache"):
        if options.get(option) is not None:
            raise InputError(f"{option}: prune quantizes nothing", hint="use quantize --method "
                             f"{method} to prune and quantize in one pass")  # fmt: skip
    return quantize(model, out, scheme="dense", method=method, **options)
