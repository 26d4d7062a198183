"""llmq's public Python API. The CLI is a thin layer over these functions.

from llmq import quantize, calibrate, evaluate
result = quantize("smollm2-135m", "out/w4a16", scheme="w4a16")
report = evaluate("out/w4a16", baseline="smollm2-135m", max_ppl_increase=0.03)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from llmq import __version__
from llmq.config import (
    RESUME_EVERY_S,
    SCAN_RATIO_THRESHOLD,
    SCAN_SCHEME,
    SCAN_SHARE_THRESHOLD,
    CalibConfig,
    Recipe,
    build,
    get_scheme,
    parse_smooth,
)
from llmq.errors import InputError
from llmq.models import BUILTIN_MODELS, cache_dir, resolve_model
from llmq.progress import NO_PROGRESS, Progress
from llmq.texts import DEFAULT_CALIBRATION_TEXT, DEFAULT_EVAL_TEXT

DEFAULT_REPORT_SAMPLES = 1
"""Calibration windows RTN uses by default: it needs no data, so they only feed the per-layer
output-error report."""
DEFAULT_CALIB_SAMPLES = 128


def _tokenizer(folder: Path) -> Any:
    from llmq.calib.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def _calibration_windows(model_dir: Path, cal: CalibConfig, progress: Progress) -> Any:
    from llmq.calib.data import calibration_windows

    with progress.stage(f"sampling calibration text {cal.text}"):
        return calibration_windows(
            _tokenizer(model_dir),
            cal.text,
            num_samples=cal.num_samples,
            seq_len=cal.seq_len,
            seed=cal.seed,
        )


def _open(model: str | Path, progress: Progress = NO_PROGRESS) -> Any:
    from llmq.io.checkpoint import open_checkpoint

    return open_checkpoint(resolve_model(model, progress=progress))


def list_models() -> list[dict[str, str]]:
    """The built-in models: name, description, and whether they are already cached."""
    return [
        {
            "name": m.name,
            "description": m.description,
            "cached": str((cache_dir() / "models" / m.name / "config.json").is_file()).lower(),
        }
        for m in BUILTIN_MODELS.values()
    ]


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
    """
    from llmq.quant.methods import get_method

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
    from llmq.io.atomic import check_free_space, check_output_dir, claim_output, staging_path
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
    if fallback_threshold is not None and str(fallback) != "auto":
        raise InputError(
            "--fallback-threshold sets the inline scan's threshold: use --fallback auto"
        )
    fallback_record = None
    if fallback is not None:
        weights = _input_weights(Path(calib_stats)) if calib_stats and str(fallback) == "auto" else None  # fmt: skip
        recipe, fallback_record = _apply_fallback(
            ckpt, recipe, fallback, fallback_threshold, weights, progress
        )
    plan = plan_quantization(ckpt, recipe)
    _check_pairings(ckpt, recipe)
    out = Path(out)
    stats = CalibStats.load(Path(calib_stats)) if calib_stats else None
    staging = staging_path(out)
    kept = partial(keep_if_resumable, staging, "rerun the same command with --resume to continue")
    with claim_output(out, kept=kept):  # held until the output is published
        check_output_dir(out, overwrite=overwrite, sources=(ckpt.path,))
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
        return run_quantization(
            ckpt, plan, recipe, out,
            calibration_ids=ids, calib_stats=stats, resume=resume, progress=progress,
            record=record, device=device, resume_every_s=resume_every_s, reference=reference,
        )  # fmt: skip


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


@dataclass(slots=True)
class CalibrateResult:
    out: Path
    model: str
    linears: int
    hessian: bool
    calibration: dict[str, Any]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out": str(self.out)}


def calibrate(
    model: str | Path,
    out: str | Path,
    *,
    calib_text: str = DEFAULT_CALIBRATION_TEXT,
    num_samples: int = DEFAULT_CALIB_SAMPLES,
    seq_len: int = 512,
    seed: int = 0,
    hessian: bool = False,
    overwrite: bool = False,
    space_check: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> CalibrateResult:
    """Collect per-linear input statistics (absmax, mean |x|, optionally XᵀX) into a
    .safetensors file that `quantize(calib_stats=...)` reuses. One run at a time writes OUT;
    `space_check=False` skips the refusal of a file that will not fit."""
    from llmq.calib.collect import collect_stats
    from llmq.calib.stats import saved_stats_bytes
    from llmq.io.atomic import check_free_space, claim_output

    started = time.perf_counter()
    cal = build(CalibConfig, text=calib_text, num_samples=num_samples, seq_len=seq_len, seed=seed)
    assert isinstance(cal, CalibConfig)
    out = Path(out)
    if out.suffix != ".safetensors":
        raise InputError(
            f"{out}: statistics are written as .safetensors", hint=f"use {out.stem}.safetensors"
        )
    ckpt = _open(model, progress)
    with claim_output(out):  # held until the file is written
        if out.exists() and not overwrite:
            raise InputError(f"{out}: already exists", hint="choose another path or pass --overwrite")  # fmt: skip
        if space_check:
            check_free_space(out, saved_stats_bytes(ckpt, hessian=hessian))
        windows = _calibration_windows(ckpt.path, cal, progress)
        stats = collect_stats(
            ckpt, windows.input_ids, hessian=hessian, progress=progress, device=device
        )
        stats.metadata = {
            "model": str(model),
            **cal.model_dump(),
            "tokens": windows.num_tokens,
            "hessian": hessian,
        }
        stats.save(out)
    return CalibrateResult(
        out=out,
        model=str(model),
        linears=len(stats.inputs),
        hessian=hessian,
        calibration=stats.metadata,
        seconds=time.perf_counter() - started,
    )


@dataclass(slots=True)
class EvalResult:
    """Perplexities under one protocol, the baseline's if given, and the gate's verdict."""

    protocol: dict[str, Any]
    model: Any  # Perplexity
    baseline: Any | None = None
    max_ppl_increase: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def increase(self) -> float | None:
        if self.baseline is None:
            return None
        return self.model.perplexity / self.baseline.perplexity - 1.0

    @property
    def passed(self) -> bool | None:
        if self.max_ppl_increase is None or self.increase is None:
            return None
        return self.increase <= self.max_ppl_increase

    def to_dict(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "model": asdict(self.model),
            "baseline": None if self.baseline is None else asdict(self.baseline),
            "increase": self.increase,
            "max_ppl_increase": self.max_ppl_increase,
            "passed": self.passed,
        }


def evaluate(
    model: str | Path,
    *,
    baseline: str | Path | None = None,
    text: str = DEFAULT_EVAL_TEXT,
    seq_len: int = 512,
    max_windows: int | None = 40,
    max_ppl_increase: float | None = None,
    use_cache: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> EvalResult:
    """Token perplexity of MODEL on held-out text, optionally against BASELINE (same windows).

    max_ppl_increase (e.g. 0.03 for 3%) makes it a gate: `result.passed` is False when the
    relative increase over the baseline exceeds it. Baseline results are cached per
    (checkpoint, windows), so repeated gates against one baseline score it once.
    """
    from llmq.calib.data import evaluation_windows
    from llmq.eval.ppl import cached_perplexity

    if seq_len < 8:
        raise InputError(f"--seq-len {seq_len}: must be >= 8")
    if max_windows is not None and max_windows < 1:
        raise InputError(f"--max-windows {max_windows}: must be >= 1")
    if max_ppl_increase is not None and baseline is None:
        raise InputError("--max-ppl-increase needs --baseline")
    if max_ppl_increase is not None and not 0 <= max_ppl_increase < 100:
        raise InputError(f"--max-ppl-increase {max_ppl_increase}: out of range")
    ckpt = _open(model, progress)
    base_ckpt = _open(baseline, progress) if baseline is not None else None
    windows = evaluation_windows(
        _tokenizer(ckpt.path), text, seq_len=seq_len, max_windows=max_windows
    )
    cache = cache_dir() / "ppl" if use_cache else None
    base = None
    if base_ckpt is not None:
        base = cached_perplexity(base_ckpt, windows, cache, progress=progress, device=device)
    result = cached_perplexity(ckpt, windows, None, progress=progress, device=device)
    protocol = {
        "metric": "token perplexity",
        "text": f"{text} (held-out split)",
        "windows": int(windows.input_ids.shape[0]),
        "seq_len": seq_len,
        "stride": seq_len,
        "bos": windows.add_bos,
        "dtype": "float32",
        "tokens_scored": result.tokens,
    }
    return EvalResult(
        protocol=protocol, model=result, baseline=base, max_ppl_increase=max_ppl_increase
    )


def verify(
    path: str | Path,
    *,
    loaders: list[str] | None = None,
    against: str | Path | None = None,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Any:
    """Load the checkpoint at PATH with each loader (default: every installed one of
    transformers, vllm, llmq), run the prompts its `llmq.json` records and compare their
    log-probabilities with the recorded reference, and its files with their recorded hashes.
    `against`: also the distance of the original model. Returns a `VerifyResult`
    (`.passed` False when a loader fails or a file changed)."""
    from llmq.eval.verify import check_loaders, installed_loaders
    from llmq.eval.verify import verify as run

    names = check_loaders(list(loaders)) if loaders else installed_loaders()
    folder = resolve_model(path, progress=progress)
    if not folder.is_dir():
        raise InputError(f"{path}: not a folder", hint="verify reads a checkpoint folder")
    original = _open(against, progress) if against is not None else None
    return run(folder, loaders=names, against=original, progress=progress, device=device)


def load_dequantized(path: str | Path) -> Any:
    """A transformers model with every quantized weight dequantized (float32), for comparison
    and inspection. Activations are not quantized by this model."""
    from llmq.runtime.load import load_dequantized as load

    return load(_open(path))


DTYPES = ("auto", "bfloat16", "float16", "float32")


def _dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise InputError(
            f"--dtype {name!r}: not a dtype", hint=f"choose one of: {', '.join(DTYPES)}"
        )
    return None if name == "auto" else getattr(torch, name)


def load_quantized(
    path: str | Path, *, device: str | None = None, dtype: str = "auto", kernels: str = "auto"
) -> Any:
    """A transformers model whose quantized linears run llmq's kernels: Triton on a GPU, the torch
    reference of the same math on the CPU (kernels="triton" or "torch" forces one).
    dtype "auto": bfloat16 on a GPU, float32 on the CPU."""
    from llmq.runtime.load import load_quantized as load

    _check_kernels(kernels)
    return load(_open(path), device=device, dtype=_dtype(dtype), kernels=kernels)  # type: ignore[arg-type]


def _check_kernels(kernels: str) -> None:
    from llmq.runtime.load import KERNEL_CHOICES

    if kernels not in KERNEL_CHOICES:
        raise InputError(
            f"--kernels {kernels!r}: not a kernel choice",
            hint=f"choose one of: {', '.join(KERNEL_CHOICES)}",
        )


@dataclass(frozen=True, slots=True)
class GenerateResult:
    model: str
    prompt: str
    text: str  # the continuation only
    new_tokens: int
    prefill_seconds: float
    decode_tokens_per_second: float
    device: str
    kernels: str  # "triton" or "torch"


def generate(
    path: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 32,
    device: str | None = None,
    dtype: str = "auto",
    kernels: str = "auto",
) -> GenerateResult:
    """Greedy continuation of `prompt` by a quantized checkpoint running on llmq's kernels."""
    from transformers import AutoTokenizer

    from llmq.runtime.generate import greedy_decode
    from llmq.runtime.load import kernels_in_use

    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if not prompt:
        raise InputError("--prompt is empty")
    folder = resolve_model(path)
    model = load_quantized(folder, device=device, dtype=dtype, kernels=kernels)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    run = greedy_decode(
        model, input_ids, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id
    )
    return GenerateResult(
        model=str(folder),
        prompt=prompt,
        text=tokenizer.decode(run.tokens, skip_special_tokens=True),
        new_tokens=len(run.tokens),
        prefill_seconds=run.prefill_seconds,
        decode_tokens_per_second=run.decode_tokens_per_second,
        device=str(next(model.parameters()).device),
        kernels=kernels_in_use(model),
    )


def bench(
    path: str | Path | None = None,
    *,
    shapes: list[str] | None = None,
    scheme: str = "w4a16",
    batch_sizes: list[int] | None = None,
    prompt_tokens: int | None = None,
    new_tokens: int | None = None,
    device: str | None = None,
    dtype: str = "auto",
    kernels: str = "auto",
    progress: Progress = NO_PROGRESS,
) -> Any:
    """Time a quantized checkpoint's layer shapes and its prefill/decode against the same weights
    dequantized to 16 bits (float32 on the CPU), in one run; or, with `shapes` ("MxNxK") and no
    path, synthetic layers of `scheme`. Returns a `llmq.runtime.bench.BenchReport`."""
    from llmq.calib.stream import resolve_device
    from llmq.runtime import bench as runtime_bench
    from llmq.runtime.load import default_dtype, kernels_in_use, use_triton
    from llmq.runtime.load import load_dequantized as load_dense

    if (path is None) == (not shapes):
        raise InputError(
            "give either a checkpoint or --shapes",
            hint="llmq bench OUT, or llmq bench --shapes 1x4096x4096",
        )
    _check_kernels(kernels)
    if prompt_tokens is not None and prompt_tokens < 1:
        raise InputError(f"--prompt-tokens {prompt_tokens}: must be at least 1")
    if new_tokens is not None and new_tokens < 2:
        raise InputError(f"--new-tokens {new_tokens}: must be at least 2 (one to time decode)")
    if path is None:
        parsed = [runtime_bench.Shape.parse(text) for text in shapes or []]
        resolved = resolve_device(device)
        compute = _dtype(dtype) or default_dtype(resolved)
        return runtime_bench.bench_shapes(
            parsed, get_scheme(scheme), device=resolved, dtype=compute,
            triton=use_triton(kernels, resolved), progress=progress,
        )  # fmt: skip
    started = time.perf_counter()
    model = load_quantized(path, device=device, dtype=dtype, kernels=kernels)
    load_seconds = time.perf_counter() - started
    first = next(model.parameters())
    gpu = first.is_cuda
    batch_sizes = batch_sizes or ([1, 16, 256] if gpu else [1, 16])
    if min(batch_sizes) < 1:
        raise InputError(f"--batch {batch_sizes}: every batch size must be at least 1")
    dense = load_dense(_open(path)).to(device=first.device, dtype=first.dtype)
    report = runtime_bench.bench_model(
        model, dense, batch_sizes=batch_sizes,
        prompt_tokens=prompt_tokens or (256 if gpu else 32),
        new_tokens=new_tokens or (64 if gpu else 8),
        dtype=first.dtype, triton=kernels_in_use(model) == "triton", progress=progress,
    )  # fmt: skip
    report.load_seconds = load_seconds
    return report


def fallback_scan(
    path: str | Path,
    *,
    scheme: str = SCAN_SCHEME,
    group_size: int | None = None,
    nrmse_threshold: float | None = None,
    ratio_threshold: float | None = SCAN_RATIO_THRESHOLD,
    include: str | None = None,
    exclude: str | None = None,
    workers: int = 1,
    sample: int | None = None,
    calib_stats: str | Path | None = None,
    error_share_threshold: float = SCAN_SHARE_THRESHOLD,
    progress: Progress = NO_PROGRESS,
) -> Any:
    """Scan every .safetensors file under PATH (a folder, a file or a built-in model name) for
    tensors that will not survive quantization under `scheme` (its group size overridden by
    `group_size`, -1 per-channel, as in `quantize`); returns a `ScanReport`.

    Flags a tensor whose NRMSE ||W - deq(q(W))|| / ||W|| exceeds `nrmse_threshold` (None: the
    scheme's default), whose spread ratio (max - min) / (Q3 - Q1) exceeds `ratio_threshold`
    (None: not used), or that holds NaN/Inf. Statistics are exact unless `sample` (values per
    tensor) is given. Needs no model class, no calibration data and no GPU. Given `calib_stats`
    (from `calibrate`), each linear's output error is estimated as sum_j ||dW_:j||^2 E[x_j^2]
    (E[x_j^2] from the Hessian's diagonal, or mean|x_j|^2 without one), and linears are flagged
    when their share of the total exceeds `error_share_threshold`."""
    from llmq.config import with_group_size
    from llmq.fallback.scan import ScanOptions, scan_args
    from llmq.fallback.scan import fallback_scan as scan

    args = with_group_size(scan_args(scheme), group_size) if group_size is not None else None
    root = Path(path)
    if not root.exists() and str(path) in BUILTIN_MODELS:
        root = resolve_model(str(path), progress=progress)
    options = ScanOptions(
        scheme=scheme, args=args, nrmse_threshold=nrmse_threshold, ratio_threshold=ratio_threshold,
        include=include, exclude=exclude, workers=workers, sample=sample,
        input_weights=_input_weights(Path(calib_stats)) if calib_stats else None,
        share_threshold=error_share_threshold,
    )  # fmt: skip
    report = scan(root, options, progress=progress)
    report.calib_stats = None if calib_stats is None else str(calib_stats)
    return report


def _input_weights(path: Path) -> dict[str, Any]:
    """Per linear, how much each input channel matters: E[x_j^2] (the Hessian's diagonal, up to
    a constant) or, for statistics collected without --hessian, mean|x_j|^2."""
    from llmq.calib.stats import CalibStats

    stats = CalibStats.load(path)
    return {
        name: s.mean_abs.square() if s.hessian is None else s.hessian.diagonal().clone()
        for name, s in stats.inputs.items()
    }
