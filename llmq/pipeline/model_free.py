"""Model-free conversion: a data-free recipe applied tensor by tensor to the safetensors files,
without building the model in transformers.

A recipe needs no model when nothing it computes reads an activation: round to nearest, with
dynamic or no activation quantization, no KV cache, no pruning. Then each linear's weight is
quantized alone (NVFP4: each set vLLM fuses stacked, for its one global scale), exactly as the
layer pipeline quantizes it (read, made float32 as the layer stream does, the same method call,
the same packing), so every tensor written is byte-identical
to the model path's, and the config's `quantization_config` too. What differs is only how the
work is cut: output shards of at most SHARD_BYTES, each shard's weights quantized by a pool of
threads (torch releases the GIL in its kernels) while another thread writes the shard before it:
memory is two shards' output and one float32 weight a thread, whatever the model's size.

What is quantized, and the output shards: `llmq.pipeline.model_free_plan`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from llmq.calib.stream import resolve_device
from llmq.config import Recipe
from llmq.io.atomic import (
    check_output_dir,
    claim_output,
    publish,
    refuse_inputs,
    save_safetensors,
    staging_path,
)
from llmq.io.checkpoint import (
    file_stamps,
    mapped_safetensors,
    read_config,
    read_safetensors_header,
    torch_dtype,
)
from llmq.io.record import OutputRecord
from llmq.io.space import check_free_space, folder_size
from llmq.pack.format import PackFormat, compress, quantization_config, scheme_format
from llmq.pack.loaders import check_required_loaders
from llmq.pipeline.job import JobInputs, JobRun
from llmq.pipeline.linears import check_finite
from llmq.pipeline.model_free_plan import ModelFreePlan, plan_model_free
from llmq.pipeline.output import ShardNames, finish_checkpoint, weights_size
from llmq.pipeline.plan import (
    LinearPlan,
    Plan,
    config_groups,
    output_bytes,
)
from llmq.pipeline.report import QuantizeResult
from llmq.pipeline.state import RunState, keep_if_resumable, load_state
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.methods import Method, get_method
from llmq.quant.primitives import ROW_STRATEGIES, QuantizedWeight

log = logging.getLogger(__name__)

# The float64 working copy of a chunk of rows quantized at once (per-row scales): L2-sized.
CHUNK_BYTES = 2 << 20


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
    total = sum(len(work.shards[i]) for i in todo)
    with (
        progress.stage("converting model-free", total=total) as step,
        ThreadPoolExecutor(count) as pool,
        ThreadPoolExecutor(1) as writer,
    ):
        writing: tuple[int, Future[None]] | None = None
        for index in todo:
            tensors = _shard_tensors(work, planned, index, pool, method, fmt)
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
    method: Method,
    fmt: PackFormat,
) -> dict[str, torch.Tensor]:
    """Output shard `index`: its planned weights quantized on the pool (a fused set as one,
    from its first member), every other tensor as stored (a view of its file's mapping, which
    stays mapped until the shard is written)."""
    tensors: dict[str, torch.Tensor] = {}
    jobs: list[Future[dict[str, torch.Tensor]]] = []
    by_file: dict[Path, list[str]] = {}
    for name in work.shards[index]:
        by_file.setdefault(work.tensors[name].shard, []).append(name)
    for path, members in by_file.items():
        entries = read_safetensors_header(path)
        with mapped_safetensors(path) as read:
            for name in members:
                linear, fused = planned.get(name), work.fused.get(name)
                if linear is None:
                    tensors[name] = read(entries[name])
                elif fused is None:
                    jobs.append(pool.submit(_quantized, method, fmt, linear, read(entries[name])))
                elif fused[0] == name:
                    linears = [planned[member] for member in fused]
                    jobs.append(pool.submit(_quantized_set, method, fmt, work, linears))
            for job in jobs:  # before the mapping is released
                tensors.update(job.result())
            jobs.clear()
    return tensors


def _quantized_set(
    method: Method, fmt: PackFormat, work: ModelFreePlan, linears: list[LinearPlan]
) -> dict[str, torch.Tensor]:
    """A fused set's on-disk tensors (NVFP4: one global scale for the set), as the layer
    pipeline computes them: the float32 weights stacked by rows, one method call, split."""
    weights = []
    for linear in linears:
        path = work.tensors[f"{linear.name}.weight"].shard
        with mapped_safetensors(path) as read:
            stored = read(read_safetensors_header(path)[f"{linear.name}.weight"])
            weights.append(stored.to(torch.float32, copy=True))  # a copy: the mapping closes
        check_finite(weights[-1], f"the weights of {linear.name}")
    assert linears[0].args is not None
    stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
    result = method.quantize_weight(stacked, linears[0].args, None, scale_dtype=torch_dtype(linears[0].dtype))  # fmt: skip
    parts = [result] if len(weights) == 1 else result.split_rows([len(w) for w in weights])
    return {
        f"{linear.name}.{suffix}": tensor
        for linear, part in zip(linears, parts, strict=True)
        for suffix, tensor in compress(part.weight, fmt).items()
    }


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
