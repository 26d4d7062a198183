"""A quantize (or one-shot prune) job from a validated Recipe: inputs checked, the run planned,
OUT claimed, calibration sampled, the layers run, the checkpoint published with its record.

`llmq.api.quantize` and `llmq.api.prune` build the Recipe from the user's options and call
`run_job`; so does quantization-aware training's export, which is why this lives below the API.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.config import RESUME_EVERY_S, QuantArgs, Recipe
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.io.record import OutputRecord
from llmq.pipeline.report import QuantizeResult

if TYPE_CHECKING:
    from llmq.mixed.choose import Budget
    from llmq.pack.format import PackFormat
    from llmq.pipeline.plan import Plan
from llmq.processes import SINGLE_PROCESS, Processes
from llmq.progress import NO_PROGRESS, Progress
from llmq.texts import text_inputs

STAGE_ACTIVATIONS = ("auto", "keep", "recompute")


@dataclass(frozen=True, slots=True)
class JobInputs:
    """What a job reads besides the model and the recipe."""

    calib_stats: str | Path | None = None  # statistics from `llmq calibrate`
    fallback: str | Path | None = None  # a fallback-scan report, or "auto"
    fallback_threshold: float | None = None  # the inline scan's (fallback "auto")
    require_loaders: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class JobRun:
    """How a job runs and writes, apart from what it computes."""

    overwrite: bool = False
    resume: bool = False
    resume_every_s: float = RESUME_EVERY_S
    space_check: bool = True
    reference: bool = True
    device: str | None = None
    stage_activations: str = "auto"  # a staged layer's: keep, recompute or auto (keeps_activations)
    tf32: bool = True  # the layers' matrix products in TF32 on a GPU
    # torchrun's processes (joined by the caller): each calibrates on its share of the windows
    processes: Processes = SINGLE_PROCESS

    def __post_init__(self) -> None:
        if self.stage_activations not in STAGE_ACTIVATIONS:
            raise InputError(
                f"--stage-activations {self.stage_activations}: not a setting",
                hint=", ".join(STAGE_ACTIVATIONS),
            )
        if not self.resume_every_s >= 0:
            raise InputError(f"--resume-every {self.resume_every_s}: must be >= 0 seconds")


def check_split(recipe: Recipe, processes: Processes) -> None:
    """Under torchrun: a recipe whose calibration windows can be split over the processes."""
    if not processes.distributed:
        return
    hint = "run it in one process (without torchrun)"
    if recipe.calibration is None:
        raise InputError(f"torchrun splits calibration windows over its {processes.world_size} processes: this recipe reads none", hint=hint)  # fmt: skip
    if recipe.calibration.num_samples < processes.world_size:
        raise InputError(f"--num-samples {recipe.calibration.num_samples}: fewer windows than torchrun's {processes.world_size} processes")  # fmt: skip
    if recipe.mixed is not None:
        raise InputError("--target-bits / --max-size: the sensitivity pass is not split over processes", hint=hint)  # fmt: skip
    if recipe.sparsity_profile != "uniform":
        raise InputError(f"--sparsity-profile {recipe.sparsity_profile}: its measuring pass is not split over processes", hint=hint)  # fmt: skip


def _weight_formats(recipe: Recipe, weights: Iterable[QuantArgs | None]) -> set[PackFormat]:
    """The formats linears of these weight arguments are written in under `recipe`'s scheme."""
    from llmq.pack.format import scheme_format, weight_format

    return {weight_format(args, scheme_format(recipe.scheme)) for args in weights if args}


def mix_loaders(
    loaders: dict[str, Any], recipe: Recipe, chosen: Iterable[QuantArgs | None]
) -> dict[str, Any]:
    """The loaders `llmq.json` records for a budget's chosen mix of formats."""
    from llmq.pack.loaders import mixed_formats_support

    support = mixed_formats_support(_weight_formats(recipe, chosen))
    if support is None:
        return loaders
    return {**loaders, support.loader: {"reads": False, "why": support.why}}


def mixed_budget(ckpt: Checkpoint, plan: Plan, recipe: Recipe, inputs: JobInputs) -> Budget | None:
    """Mixed precision's budget over the planned linears (refused now if it cannot be met, or
    if a loader required could not read a mix its candidates may make)."""
    from llmq.io.checkpoint import torch_dtype
    from llmq.mixed.choose import plan_budget
    from llmq.mixed.units import Linear, SchemeCandidate
    from llmq.pack.loaders import mixed_formats_support

    if recipe.mixed is None:
        return None
    if inputs.fallback is not None:
        raise InputError("--fallback: under a budget the solver chooses which linears stay dense", hint="drop --fallback")  # fmt: skip
    layers = [
        [Linear(p.name, p.out_features, p.in_features, torch_dtype(p.dtype)) for p in layer]
        for layer in plan.layers
    ]
    budget = plan_budget(ckpt, layers, recipe.mixed)
    candidates = [c.args for c in budget.candidates if isinstance(c, SchemeCandidate)]
    unread = mixed_formats_support(_weight_formats(recipe, candidates))
    if unread is not None and unread.loader in inputs.require_loaders:
        names = ", ".join(budget.config.candidates or ())
        raise InputError(f"--require-loader transformers: a mix of --candidates {names} may hold FP4 or MX groups beside others, which transformers does not read", hint="choose FP4/MX candidates alone, or none")  # fmt: skip
    return budget


def run_job(
    ckpt: Checkpoint,
    out: Path,
    recipe: Recipe,
    *,
    source: str,
    inputs: JobInputs = JobInputs(),
    run: JobRun = JobRun(),
    progress: Progress = NO_PROGRESS,
    damages: dict[str, list[float]] | None = None,
) -> QuantizeResult:
    """Quantize or prune `ckpt` into a checkpoint at OUT as `recipe` says. `source`: how the
    user named the model (recorded). Everything is validated before any work. `damages`: mixed
    precision's measured damages, shared by the attempts of a perplexity gate."""
    from llmq.calib.stats import CalibStats
    from llmq.calib.windows import model_windows
    from llmq.io.atomic import (
        check_output_dir,
        claim_output,
        refuse_inputs,
        staging_path,
    )
    from llmq.io.space import check_free_space
    from llmq.mixed.choose import choose, fitted_schemes
    from llmq.pack.format import scheme_format
    from llmq.pack.loaders import check_required_loaders
    from llmq.pipeline.plan import disk_needed, plan_quantization, with_schemes
    from llmq.pipeline.prepare import (
        apply_fallback,
        check_kv_cache,
        check_pairings,
        fallback_input,
        layer_profile,
    )
    from llmq.pipeline.quantize import run_quantization
    from llmq.pipeline.state import keep_if_resumable

    loaders = check_required_loaders(recipe.weight_args, scheme_format(recipe.scheme), inputs.require_loaders)  # fmt: skip
    read = [("model", ckpt.path), ("statistics file", inputs.calib_stats), *fallback_input(inputs.fallback)]  # fmt: skip
    if recipe.calibration is not None:
        read += text_inputs(recipe.calibration.text, "calibration text")
    refuse_inputs(out, read)  # before the fallback scan, the first work
    fallback_record = None
    if inputs.fallback is not None:
        recipe, fallback_record = apply_fallback(
            ckpt, recipe, inputs.fallback, inputs.fallback_threshold, inputs.calib_stats, progress
        )
    plan = plan_quantization(ckpt, recipe)
    budget = mixed_budget(ckpt, plan, recipe, inputs)
    check_pairings(ckpt, recipe)
    check_kv_cache(ckpt, recipe)
    stats = CalibStats.load(Path(inputs.calib_stats)) if inputs.calib_stats else None
    processes = run.processes
    check_split(recipe, processes)
    staging = staging_path(out)
    kept = partial(keep_if_resumable, staging, "rerun the same command with --resume to continue")

    def check_output() -> None:
        check_output_dir(out, overwrite=run.overwrite)
        if run.space_check:
            # mixed precision's choice is not made yet: at most every linear dense
            planned = plan if budget is None else with_schemes(plan, dict.fromkeys(n.name for n in plan.linears))  # fmt: skip
            check_free_space(
                out, disk_needed(ckpt, planned, recipe, staging if run.resume else None)
            )

    with ExitStack() as claimed:  # held until the output is published (by process 0)
        processes.on_main(lambda: claimed.enter_context(claim_output(out, inputs=read, kept=kept)))  # fmt: skip
        processes.on_main(check_output)
        record = OutputRecord(source_model=source, recipe=recipe.model_dump(mode="json"), loaders=loaders)  # fmt: skip
        ids = None
        if recipe.calibration is not None:
            cal = recipe.calibration
            windows = processes.on_main(lambda: model_windows(ckpt.path, cal, progress))
            ids = windows.input_ids[processes.rank :: processes.world_size]  # this process's
            dense = set() if ckpt.layout.experts else {"moe_calibration"}  # routes nothing
            record.calibration = {**cal.model_dump(exclude=dense), "tokens": windows.num_tokens, "bos": windows.add_bos}  # fmt: skip
        if stats is not None:
            record.calib_stats = {"file": str(inputs.calib_stats), **stats.metadata}
        if fallback_record is not None:
            record.fallback = fallback_record
        if budget is not None:
            chosen, record.mixed_precision = choose(ckpt, budget, ids, stats, progress=progress, device=run.device, measured=damages)  # fmt: skip
            schemes = fitted_schemes(chosen)
            plan, record.loaders = with_schemes(plan, schemes), mix_loaders(loaders, recipe, schemes.values())  # fmt: skip
        sparsities = None
        if recipe.sparsity_profile != "uniform":
            sparsities = layer_profile(ckpt, plan, recipe, ids, progress, run.device)
            record.sparsity_profile = sparsities
        return run_quantization(
            ckpt, plan, recipe, out,
            calibration_ids=ids, calib_stats=stats, resume=run.resume, progress=progress,
            record=record, device=run.device, resume_every_s=run.resume_every_s,
            reference=run.reference, stage_activations=run.stage_activations, tf32=run.tf32,
            layer_sparsities=None if sparsities is None else sparsities["sparsity"],
            processes=processes,
        )  # fmt: skip
