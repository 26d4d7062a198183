"""What a quantize or prune job settles before its first layer, beyond the plan of each linear:
the linears a fallback scan keeps in full precision (joined to the recipe's `ignore`), whether
the family has the norm/linear pairings AWQ and SmoothQuant fold scales into, and the per-layer
sparsities of a sparsity profile (measured on the dense model in one calibration pass)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmq.config import SCAN_SHARE_THRESHOLD, Recipe
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.progress import Progress


def fallback_input(fallback: str | Path | None) -> list[tuple[str, Path]]:
    """The fallback report a run reads, as an input no output may cover."""
    return [] if fallback is None or str(fallback) == "auto" else [("fallback report", Path(fallback))]  # fmt: skip


def apply_fallback(
    ckpt: Checkpoint,
    recipe: Recipe,
    fallback: str | Path,
    threshold: float | None,
    calib_stats: str | Path | None,
    progress: Progress,
) -> tuple[Recipe, dict[str, Any]]:
    """The recipe with the linears a scan flags added to `ignore`, and what was kept and why.
    `fallback`: a report file, or "auto" to scan now with the recipe's weight arguments (by
    output error share when `calib_stats` is given, else by NRMSE)."""
    from llmq.fallback.options import ScanOptions
    from llmq.fallback.report import ScanReport
    from llmq.fallback.scan import fallback_scan as scan

    if recipe.weight_args is None:
        raise InputError("--fallback keeps linears out of quantization; pruning alone has none")
    if str(fallback) == "auto":
        input_weights = _input_weights(Path(calib_stats)) if calib_stats else None
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


def _input_weights(path: Path) -> dict[str, Any]:
    from llmq.calib.stats import CalibStats

    return CalibStats.load(path).input_weights()


def check_pairings(ckpt: Checkpoint, recipe: Recipe) -> None:
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


def check_kv_cache(ckpt: Checkpoint, recipe: Recipe) -> None:
    """KV cache scales are for the keys and values attention stores; a latent-attention family
    (DeepSeek) stores a compressed latent instead: refused, before any work."""
    if recipe.kv_cache_args is not None and ckpt.layout.latent_attention:
        raise InputError(
            f"--kv-cache: model_type {ckpt.config.get('model_type')!r} caches a compressed "
            "latent (multi-head latent attention), not keys and values",
            hint="leave out --kv-cache",
        )


def layer_profile(
    ckpt: Checkpoint, plan: Any, recipe: Recipe, ids: Any, progress: Progress, device: str | None
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
