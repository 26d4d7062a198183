"""`quantize` and `prune`: the user's options made into a Recipe, run as a layer-pipeline job."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.api.common import _open, options_of
from llmq.config import RESUME_EVERY_S, PruneOptions, QuantizeOptions, Recipe
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:
    from llmq.pipeline.report import QuantizeResult


def make_recipe(**options: Any) -> Recipe:
    """The Recipe that `quantize(**options)` would run (InputError naming the option on a bad
    value); the options are QuantizeOptions' (llmq.config.options)."""
    return QuantizeOptions.of(**options).recipe()


def quantize(
    model: str | Path,
    out: str | Path,
    options: QuantizeOptions | None = None,
    *,
    recipe: Recipe | None = None,
    overwrite: bool = False,
    resume: bool = False,
    resume_every_s: float = RESUME_EVERY_S,
    space_check: bool = True,
    reference: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    stage_activations: str = "auto",
    tf32: bool = True,
    **values: Any,
) -> QuantizeResult:
    """Quantize MODEL (a folder or built-in name) into a compressed-tensors checkpoint at OUT.

    The options are `QuantizeOptions` (the CLI's, by their Python names: scheme, method,
    group_size, ignore, clip, calib_text, num_samples, ..., calib_stats, fallback,
    require_loaders), given as an object or as keywords; or pass a ready `recipe`. `fallback`: a
    `fallback_scan` JSON report, or "auto" to scan now; the linears it flags stay in full
    precision and join the checkpoint's `ignore` list. `resume_every_s`: seconds between the
    resume points an interrupted run continues from with `resume=True` (0: after every layer).
    One run at a time writes OUT; `overwrite` replaces only an output llmq wrote, once the new
    one is complete; `space_check=False` skips the refusal, before any work, of an output that
    will not fit. `reference`: record in llmq.json what the written files compute on a few
    prompts, for `verify`. `device`: where each layer runs (default: the GPU when there is one).
    `stage_activations`: whether GPTQ's stages inside a layer keep their activations ("keep"),
    recompute them to hold one copy ("recompute"), or keep them where they fit ("auto"). `tf32`:
    the layers' matrix products in TF32 on a GPU (False: true float32).
    """
    options = options_of(QuantizeOptions, options, values)
    if options.format == "gguf":
        from llmq.api.gguf import quantize_gguf

        return quantize_gguf(model, out, options.gguf_recipe(), overwrite=overwrite,
                             progress=progress, device=device)  # fmt: skip
    return _job(model, out, options, recipe or options.recipe(), progress, overwrite=overwrite,
                resume=resume, resume_every_s=resume_every_s, space_check=space_check,
                reference=reference, device=device, stage_activations=stage_activations,
                tf32=tf32)  # fmt: skip


def prune(
    model: str | Path,
    out: str | Path,
    options: PruneOptions | None = None,
    *,
    overwrite: bool = False,
    resume: bool = False,
    resume_every_s: float = RESUME_EVERY_S,
    space_check: bool = True,
    reference: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    stage_activations: str = "auto",
    tf32: bool = True,
    **values: Any,
) -> QuantizeResult:
    """Prune MODEL (a folder or built-in name) into a plain Hugging Face checkpoint at OUT: the
    pruned weights stay in their dtype, so every loader reads it, and llmq.json records the
    sparsity. The options are `PruneOptions`: `method` magnitude (no data), wanda or sparsegpt,
    with `sparsity` (the share of each row's weights removed) or `pattern` ("2:4"), and the
    layer pipeline's calibration and ignore options; the rest as in `quantize`."""
    options = options_of(PruneOptions, options, values)
    return _job(model, out, options, options.recipe(), progress, overwrite=overwrite,
                resume=resume, resume_every_s=resume_every_s, space_check=space_check,
                reference=reference, device=device, stage_activations=stage_activations,
                tf32=tf32)  # fmt: skip


def _job(
    model: str | Path,
    out: str | Path,
    options: QuantizeOptions | PruneOptions,
    recipe: Recipe,
    progress: Progress,
    **run: Any,
) -> QuantizeResult:
    from llmq.pipeline.job import JobInputs, JobRun, run_job

    quantizing = isinstance(options, QuantizeOptions)
    inputs = JobInputs(
        calib_stats=options.calib_stats,
        fallback=options.fallback if quantizing else None,
        fallback_threshold=options.fallback_threshold if quantizing else None,
        require_loaders=tuple(options.require_loaders) if quantizing else (),
    )  # fmt: skip
    ckpt = _open(model, progress)
    return run_job(ckpt, Path(out), recipe, source=str(model), inputs=inputs, run=JobRun(**run), progress=progress)  # fmt: skip
