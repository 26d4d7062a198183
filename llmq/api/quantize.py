"""`quantize` and `prune`: the user's options made into a Recipe, run as a layer-pipeline job."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.api.common import _open, options_of
from llmq.config import RESUME_EVERY_S, PruneOptions, QuantizeOptions, Recipe
from llmq.errors import InputError
from llmq.io.checkpoint import checkpoint_folder, read_config
from llmq.models import resolve_model
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:
    from llmq.pipeline.job import JobInputs, JobRun
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
    model_free: bool | None = None,
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
    the layers' matrix products in TF32 on a GPU (False: true float32). `model_free`: convert
    tensor by tensor without building the model (llmq.pipeline.model_free): by default (None)
    when the recipe needs no data; True or False forces it.
    """
    options = options_of(QuantizeOptions, options, values)
    if options.format == "gguf":
        from llmq.api.gguf import quantize_gguf

        _one_process("--format gguf")

        return quantize_gguf(model, out, options.gguf_recipe(), overwrite=overwrite,
                             progress=progress, device=device)  # fmt: skip
    from llmq.pipeline.job import JobRun
    from llmq.pipeline.model_free import run_model_free
    from llmq.pipeline.model_free_plan import converts_model_free

    recipe = recipe or options.recipe()
    inputs = _inputs(options)
    run = JobRun(overwrite=overwrite, resume=resume, resume_every_s=resume_every_s,
                 space_check=space_check, reference=reference, device=device,
                 stage_activations=stage_activations, tf32=tf32)  # fmt: skip
    folder = checkpoint_folder(resolve_model(model, progress=progress))
    config = read_config(folder)
    if converts_model_free(recipe, inputs, model_free, options.calibration_given(), config):
        _one_process("model-free conversion")
        return run_model_free(folder, Path(out), recipe, source=str(model), inputs=inputs, run=run, progress=progress)  # fmt: skip
    return _job(model, out, recipe, inputs, run, progress)


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
    from llmq.pipeline.job import JobRun

    run = JobRun(overwrite=overwrite, resume=resume, resume_every_s=resume_every_s,
                 space_check=space_check, reference=reference, device=device,
                 stage_activations=stage_activations, tf32=tf32)  # fmt: skip
    return _job(model, out, options.recipe(), _inputs(options), run, progress)


def _inputs(options: QuantizeOptions | PruneOptions) -> JobInputs:
    """What the job reads besides the model (a pruning job: only statistics)."""
    from llmq.pipeline.job import JobInputs

    if not isinstance(options, QuantizeOptions):
        return JobInputs(calib_stats=options.calib_stats)
    return JobInputs(
        calib_stats=options.calib_stats, fallback=options.fallback,
        fallback_threshold=options.fallback_threshold,
        require_loaders=tuple(options.require_loaders),
    )  # fmt: skip


def _job(
    model: str | Path,
    out: str | Path,
    recipe: Recipe,
    inputs: JobInputs,
    run: JobRun,
    progress: Progress,
) -> QuantizeResult:
    from llmq.pipeline.gated import run_gated_job
    from llmq.pipeline.job import run_job
    from llmq.processes import launched

    ckpt = _open(model, progress)
    if recipe.mixed is not None and recipe.mixed.max_ppl_increase is not None:
        return run_gated_job(ckpt, Path(out), recipe, source=str(model), inputs=inputs, run=run, progress=progress)  # fmt: skip
    if not launched().distributed:
        return run_job(ckpt, Path(out), recipe, source=str(model), inputs=inputs, run=run, progress=progress)  # fmt: skip
    with _processes_joined(run) as run:  # under torchrun: the calibration windows split
        shown = progress if run.processes.is_main else NO_PROGRESS
        return run_job(ckpt, Path(out), recipe, source=str(model), inputs=inputs, run=run, progress=shown)  # fmt: skip


@contextmanager
def _processes_joined(run: JobRun) -> Iterator[JobRun]:
    """`run` as one of torchrun's processes: in their group, on its own GPU where there are
    GPUs; the group is left on exit."""
    import torch

    from llmq.calib.stream import resolve_device
    from llmq.processes import join_processes, leave_processes, process_device

    device = resolve_device(run.device)
    processes = join_processes(device)
    try:
        device = process_device(device, processes)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        yield replace(run, device=str(device), processes=processes)
    finally:
        leave_processes(processes)


def _one_process(what: str) -> None:
    """Refuse, under torchrun, what has no calibration windows to split."""
    from llmq.processes import launched

    processes = launched()
    if processes.distributed:
        raise InputError(
            f"{what} reads no calibration windows to split over torchrun's {processes.world_size} processes",
            hint="run it in one process (without torchrun)",
        )  # fmt: skip
