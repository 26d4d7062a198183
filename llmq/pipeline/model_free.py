"""Model-free conversion: a data-free recipe applied tensor by tensor to the safetensors files,
without building the model in transformers.

A recipe needs no model when nothing it computes reads an activation: round to nearest, with
dynamic or no activation quantization, no KV cache, no pruning. Then each linear's weight is
quantized alone, exactly as the layer pipeline quantizes it (read, made float32 as the layer
stream does, the same method call, the same packing), so every tensor written is byte-identical
to the model path's, and the config's `quantization_config` too. What differs is only how the
work is cut: output shards of at most SHARD_BYTES, each shard's weights quantized by a pool of
threads (torch releases the GIL in its kernels) while another thread writes the shard before it:
memory is two shards' output and one float32 weight a thread, whatever the model's size.

Which tensors are quantized: the family layout's decoder linears when llmq knows the family
(the model path's own plan), else every 2-D floating-point weight that `is_linear_weight`
accepts; `--targets` patterns choose instead. The LM head and `--ignore` stay as they are.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from llmq.calib.stream import resolve_device
from llmq.config import Recipe
from llmq.errors import InputError, UnsupportedModelError
from llmq.io.atomic import (
    check_output_dir,
    claim_output,
    publish,
    refuse_inputs,
    save_safetensors,
    staging_path,
)
from llmq.io.checkpoint import (
    TensorInfo,
    file_stamps,
    mapped_safetensors,
    read_config,
    read_safetensors_header,
    stored_tensors,
    torch_dtype,
)
from llmq.io.family import is_linear_weight, layout_for_config, stores_fused_experts
from llmq.io.fp8_release import fp8_block_size
from llmq.io.record import OutputRecord
from llmq.io.space import check_free_space, folder_size
from llmq.pack.format import PackFormat, compress, quantization_config, scheme_format
from llmq.pack.loaders import check_required_loaders
from llmq.pipeline.job import JobInputs, JobRun
from llmq.pipeline.linears import check_finite
from llmq.pipeline.output import ShardNames, finish_checkpoint, weights_size
from llmq.pipeline.plan import (
    FLOAT_DTYPES,
    LinearPlan,
    Plan,
    check_patterns,
    config_groups,
    matches_any,
    output_bytes,
    plan_linears,
    refuse_quantized,
)
from llmq.pipeline.report import QuantizeResult
from llmq.pipeline.state import RunState, keep_if_resumable, load_state
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.methods import Method, get_method
from llmq.quant.primitives import ROW_STRATEGIES, QuantizedWeight

log = logging.getLogger(__name__)

# An output shard's size at most (the last tensor may pass it; a larger tensor is a shard of its
# own): what one thread holds before the shard is written.
SHARD_BYTES = 1 << 30
# The float64 working copy of a chunk of rows quantized at once (per-row scales): L2-sized.
CHUNK_BYTES = 2 << 20


def model_free_refusal(recipe: Recipe, inputs: JobInputs, config: dict[str, Any]) -> str | None:
    """Why converting the model of `config` with `recipe` needs the model and its activations
    (None: it does not)."""
    if stores_fused_experts(config):
        return f"model_type {config.get('model_type')!r} stores its experts fused: the layer pipeline splits them into linears"  # fmt: skip
    if fp8_block_size(config) is not None:
        return "an FP8 block release is read as bfloat16 by the layer pipeline"
    if recipe.weight_args is None or recipe.sparsity is not None or recipe.pattern is not None:
        return f"--method {recipe.method} prunes on the layers' activations"
    if recipe.method != "rtn":
        return f"--method {recipe.method} calibrates on the layers' activations"
    if recipe.mixed is not None:
        return "--target-bits and --max-size measure each linear before choosing its scheme"
    if recipe.needs_calibration:
        return (
            "static activation scales, NVFP4's input global scales, --smooth and --kv-cache are "
            "calibrated on activations"
        )
    if recipe.weight_args.strategy == "tensor_group":
        return (
            "NVFP4 gives the linears vLLM fuses (q/k/v, gate/up) one global scale, and "
            "model-free conversion quantizes each weight alone"
        )
    if recipe.clip == "output":
        return "--clip output weighs errors by the layers' activations"
    if inputs.fallback is not None or inputs.calib_stats is not None:
        return "--fallback and --calib-stats are read against the model's layers"
    return None


def converts_model_free(
    recipe: Recipe,
    inputs: JobInputs,
    model_free: bool | None,
    calibration: list[str],
    config: dict[str, Any],
) -> bool:
    """Whether the run converts the model of `config` model-free: by default when the recipe
    and the family allow it and no calibration option was given (`calibration`: their names;
    they ask for the layer pipeline's per-layer check); `model_free` True or False forces it.
    Forcing it where it cannot run, or with calibration options it would not read, is refused
    in one line."""
    if recipe.targets and model_free is False:
        raise InputError(
            "--targets chooses the tensors of model-free conversion: drop --no-model-free",
            hint="the model path quantizes the family's linears: use --ignore to keep some",
        )
    forced = "--model-free" if model_free else "--targets (model-free)" if recipe.targets else None
    refusal = model_free_refusal(recipe, inputs, config)
    if forced and refusal:
        raise InputError(f"{forced}: {refusal}", hint="drop --model-free and --targets")
    if forced and calibration:
        option = "--" + calibration[0].replace("_", "-")
        raise InputError(f"{option}: model-free conversion reads no calibration text", hint=f"drop {option}, or {forced.split()[0]}")  # fmt: skip
    if model_free is None and not forced:
        return refusal is None and not calibration
    return bool(forced)


@dataclass(slots=True)
class ModelFreePlan:
    plan: Plan
    tensors: dict[str, TensorInfo]
    shards: list[list[str]]  # the stored tensors of each output shard, in order
    targets: str  # which rule chose the linears, for the record and the report
    family_known: bool  # whether llmq can build the layers (for the `verify` reference)


def plan_model_free(folder: Path, recipe: Recipe) -> ModelFreePlan:
    """The linears to quantize and the output shards, from config.json and the headers."""
    config = read_config(folder)
    refuse_quantized(folder, config)
    tensors = stored_tensors(folder)
    layout, layers = None, None
    if not recipe.targets:
        try:
            layout = layout_for_config(config)
        except (UnsupportedModelError, InputError):
            layout = None  # a family llmq cannot lay out: every linear-looking weight
    if layout is not None:
        layers = [layout.linear_names(i) for i in range(int(config["num_hidden_layers"]))]
        rule = f"the {config.get('model_type')} layout's decoder linears"
    else:
        layers = [_chosen_linears(tensors, recipe.targets)]
        rule = ("--targets " + " ".join(recipe.targets)) if recipe.targets else "every 2-D linear weight"  # fmt: skip
    lm_head = layout.lm_head if layout is not None else "lm_head"
    plan = plan_linears(folder, tensors, layers, recipe, lm_head=lm_head)
    planned = {f"{linear.name}.weight": linear for linear in plan.linears}
    return ModelFreePlan(plan, tensors, _output_shards(tensors, planned), rule, layout is not None)


def _chosen_linears(tensors: dict[str, TensorInfo], patterns: tuple[str, ...]) -> list[str]:
    """Module names of the 2-D float weights the patterns match (every linear-looking one
    without patterns); a pattern that matches none of them is refused."""
    candidates = [
        name.removesuffix(".weight")
        for name, info in tensors.items()
        if name.endswith(".weight") and len(info.shape) == 2 and info.dtype in FLOAT_DTYPES
    ]
    if not patterns:
        return [name for name in candidates if is_linear_weight(name)]
    check_patterns("--targets", patterns, candidates, "2-D floating-point weights")
    return [name for name in candidates if matches_any(patterns, name)]


def _output_shards(
    tensors: dict[str, TensorInfo], planned: dict[str, LinearPlan]
) -> list[list[str]]:
    """The stored tensors cut into output shards of about SHARD_BYTES, in the source's order
    (shard by shard, then by name), so that a thread reads mostly one source file."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors, key=lambda n: (tensors[n].shard.name, n)):
        info = tensors[name]
        linear = planned.get(name)
        nbytes = _stored_bytes(info) if linear is None else _packed_bytes(linear)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _stored_bytes(info: TensorInfo) -> int:
    return torch_dtype(info.dtype).itemsize * math.prod(info.shape)


def _packed_bytes(linear: LinearPlan) -> int:
    assert linear.args is not None
    return max(1, linear.out_features * linear.in_features * linear.args.num_bits // 8)


def run_model_free(
    folder: Path,
    out: Path,
    recipe: Recipe,
    *,
    source: str,
    inputs: JobInputs,
    run: JobRun,
    workers: int | None = None,
    progress: Progress = NO_PROGRESS,
) -> QuantizeResult:
    """Convert the checkpoint at `folder` into a compressed-tensors one at `out`, model-free.
    Everything is validated before any work; `run` says how it writes (overwrite, resume, the
    space check, the `verify` reference); `workers`: threads (default: one per core, up to 8)."""
    started = time.perf_counter()
    loaders = check_required_loaders(recipe.weight_args, scheme_format(recipe.scheme), inputs.require_loaders)  # fmt: skip
    work = plan_model_free(folder, recipe)
    refuse_inputs(out, [("model", folder)])
    if run.reference:
        resolve_device(run.device)  # the reference pass's: a bad one fails before any work
    recipe = recipe.model_copy(update={"calibration": None})  # no window is read
    staging = staging_path(out)
    kept = partial(keep_if_resumable, staging, "rerun the same command with --resume to continue")
    with claim_output(out, inputs=[("model", folder)], kept=kept):
        check_output_dir(out, overwrite=run.overwrite)
        state = _state(staging, recipe, work, folder, run)
        done = {entry["shard"] for entry in state.layers}
        if run.space_check:
            check_free_space(
                out, output_bytes(folder, work.tensors, work.plan) - folder_size(staging)
            )
        names = ShardNames(len(work.shards))
        convert_started = time.perf_counter()
        count = _convert(work, recipe, staging, names, done, state, workers, progress)
        seconds = time.perf_counter() - convert_started
        config = {**read_config(folder), "quantization_config": _config(work.plan, recipe)}
        record = OutputRecord(
            source_model=source, recipe=recipe.model_dump(mode="json"), loaders=loaders,
            model_free={"targets": work.targets, "quantized": len(work.plan.linears),
                        "shards": len(work.shards), "workers": count,
                        "seconds": round(seconds, 3)},
        )  # fmt: skip
        with progress.stage("writing config, index and the reference for `llmq verify`"):
            finish_checkpoint(
                folder, staging, names, config, record, run.device,
                reference=run.reference and work.family_known,
            )  # fmt: skip
        publish(staging, out)
    return QuantizeResult(
        out_dir=out, model=str(folder), scheme=recipe.scheme.name, method=recipe.method,
        layers=[], ignored=work.plan.ignored,
        group_size_adjustments=[asdict(a) for a in work.plan.adjustments],
        calibration=None, loaders=loaders or {}, resumed_layers=len(done),
        seconds=time.perf_counter() - started,
        size_bytes={"source": weights_size(folder), "output": weights_size(out)},
        model_free=record.model_free,
    )  # fmt: skip


def _state(
    staging: Path, recipe: Recipe, work: ModelFreePlan, folder: Path, run: JobRun
) -> RunState:
    """The resume state: the shards finished by an interrupted run with the same fingerprint
    (with --resume), else a fresh staging folder."""
    fingerprint = {
        "recipe": recipe.model_dump(mode="json"),
        "source": file_stamps(folder, work.tensors),
        "model_free_shards": len(work.shards),
    }
    state = load_state(staging, fingerprint, 0.0) if run.resume else None
    if state is None:
        if run.resume:
            log.warning("%s: no interrupted run to resume; starting from the first shard", staging)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        state = RunState(staging, fingerprint, every_s=0.0)
    return state


def _config(plan: Plan, recipe: Recipe) -> dict[str, Any]:
    return quantization_config(
        config_groups(plan), ignore=plan.ignored, fmt=scheme_format(recipe.scheme)
    )


def _convert(
    work: ModelFreePlan,
    recipe: Recipe,
    staging: Path,
    names: ShardNames,
    done: set[str],
    state: RunState,
    workers: int | None,
    progress: Progress,
) -> int:
    """Write every output shard not already `done`: each shard's weights quantized by a pool of
    threads, the shard written by another thread while the pool goes on with the next (at most
    two shards held). Returns the pool's threads."""
    todo = [i for i in range(len(work.shards)) if names.name(i) not in done]
    count = max(1, workers or min(os.cpu_count() or 1, 8))
    planned = {f"{linear.name}.weight": linear for linear in work.plan.linears}
    method, fmt = get_method(recipe), scheme_format(recipe.scheme)
    quantize = partial(_quantized, method, fmt)
    total = sum(len(work.shards[i]) for i in todo)
    with (
        progress.stage("converting model-free", total=total) as step,
        ThreadPoolExecutor(count) as pool,
        ThreadPoolExecutor(1) as writer,
    ):
        writing: tuple[int, Future[None]] | None = None
        for index in todo:
            tensors = _shard_tensors(work, planned, index, pool, quantize)
            if writing is not None:
                _written(*writing, state, names)
            path = staging / names.name(index)
            writing = index, writer.submit(save_safetensors, path, tensors)
            step(len(work.shards[index]))
        if writing is not None:
            _written(*writing, state, names)
    return count


def _written(index: int, saving: Future[None], state: RunState, names: ShardNames) -> None:
    """Wait for shard `index` to be written, then list it as finished (for --resume)."""
    saving.result()
    state.record({"shard": names.name(index)}, None)


def _shard_tensors(
    work: ModelFreePlan,
    planned: dict[str, LinearPlan],
    index: int,
    pool: ThreadPoolExecutor,
    quantize: Callable[[LinearPlan, torch.Tensor], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Output shard `index`: its planned weights quantized on the pool, every other tensor as
    stored (a view of its file's mapping, which stays mapped until the shard is written)."""
    tensors: dict[str, torch.Tensor] = {}
    jobs: list[Future[dict[str, torch.Tensor]]] = []
    by_file: dict[Path, list[str]] = {}
    for name in work.shards[index]:
        by_file.setdefault(work.tensors[name].shard, []).append(name)
    for path, members in by_file.items():
        entries = read_safetensors_header(path)
        with mapped_safetensors(path) as read:
            for name in members:
                linear = planned.get(name)
                if linear is None:
                    tensors[name] = read(entries[name])
                else:
                    jobs.append(pool.submit(quantize, linear, read(entries[name])))
            for job in jobs:  # before the mapping is released
                tensors.update(job.result())
            jobs.clear()
    return tensors


def _quantized(
    method: Method, fmt: PackFormat, linear: LinearPlan, stored: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One weight's on-disk tensors, as the layer pipeline computes them: made float32 as the
    layer stream materializes it, then the same method call and packing. Weights with per-row
    scales go through in chunks of rows whose float64 working copies stay in the CPU's cache
    (2.5x faster than the whole weight at once here; rows are independent, so the bytes are
    the same)."""
    assert linear.args is not None
    rows = len(stored)
    if linear.args.strategy in ROW_STRATEGIES:
        rows = max(1, CHUNK_BYTES // (8 * linear.in_features))
    parts = []
    for start in range(0, len(stored), rows):
        weight = stored[start : start + rows].to(torch.float32)
        check_finite(weight, f"the weights of {linear.name}")
        result = method.quantize_weight(weight, linear.args, None, scale_dtype=torch_dtype(linear.dtype))  # fmt: skip
        parts.append(result.weight)
    joined = parts[0] if len(parts) == 1 else QuantizedWeight.joined_rows(parts)  # type: ignore[arg-type]
    return {f"{linear.name}.{suffix}": tensor for suffix, tensor in compress(joined, fmt).items()}  # fmt: skip
