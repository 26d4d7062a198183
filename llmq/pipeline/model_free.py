"""Model-free conversion: a data-free recipe applied tensor by tensor to the safetensors files,
without building the model in transformers.

A recipe needs no model when nothing it computes reads an activation: round to nearest, with
dynamic or no activation quantization, no KV cache, no pruning. Then each linear's weight is
quantized alone (NVFP4: each set vLLM fuses stacked, for its one global scale), exactly as the
layer pipeline quantizes it (read, made float32 as the layer stream does, the same method call,
the same packing), so every tensor written is byte-identical to the model path's, and the
config's `quantization_config` too. What differs is only how the work is cut: output shards of
at most SHARD_BYTES, each written tensor by tensor (`llmq.io.stream`) as a pool of threads
finishes quantizing them (torch releases the GIL in its kernels; each thread's ops use one
share of the cores), while the kernel reads the source ahead of them
(`llmq.io.readahead`): memory is a few tensors in flight and a float32 chunk a thread, whatever
the model's size, and a cold read overlaps the arithmetic.

What is quantized, and the output shards: `llmq.pipeline.model_free_plan`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from llmq.calib.stream import resolve_device
from llmq.config import Recipe
from llmq.cpu import threads_per_worker
from llmq.heap import reused_heap
from llmq.io.atomic import check_output_dir, claim_output, publish, refuse_inputs, staging_path
from llmq.io.checkpoint import file_stamps, read_config
from llmq.io.readahead import ReadAhead
from llmq.io.record import OutputRecord
from llmq.io.space import check_free_space, folder_size
from llmq.io.stream import StreamedSafetensors, header_room, streamed_safetensors
from llmq.pack.format import quantization_config, scheme_format
from llmq.pack.loaders import check_required_loaders
from llmq.pipeline.job import JobInputs, JobRun
from llmq.pipeline.model_free_plan import ModelFreePlan, plan_model_free
from llmq.pipeline.model_free_stream import ConversionStream, Written
from llmq.pipeline.output import ShardNames, finish_checkpoint, weights_size
from llmq.pipeline.plan import Plan, config_groups, output_bytes
from llmq.pipeline.report import QuantizeResult
from llmq.pipeline.state import RunState, keep_if_resumable, load_state
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.methods import get_method

log = logging.getLogger(__name__)

# The most tensors one quantized weight is written as (codes, scale, zero point, global scale,
# shape, g_idx): for the header's room.
_MAX_PACKED_TENSORS = 6


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
    """Write every output shard not already `done`, tensor by tensor as the stream hands them
    out (the kernel reading the source ahead). Returns the pool's threads."""
    todo = [i for i in range(len(work.shards)) if names.name(i) not in done]
    count = max(1, workers or min(os.cpu_count() or 1, 8))
    stream = ConversionStream(work, todo, get_method(recipe), scheme_format(recipe.scheme))
    total = sum(len(work.shards[i]) for i in todo)
    with (
        progress.stage("converting model-free", total=total) as step,
        threads_per_worker(count),
        reused_heap(),  # every chunk of rows allocates the same few MB
        ThreadPoolExecutor(count) as pool,
        ReadAhead() as ahead,
        _ShardFiles(stream, staging, names, state, step) as files,
    ):
        for index, tensors in stream.results(pool, ahead):
            files.add(index, tensors)
    return count


class _ShardFiles:
    """The output shard being written: opened at its first tensor, renamed whole and recorded
    for --resume when the next shard's first tensor comes or the block ends; removed when the
    block fails."""

    def __init__(
        self,
        stream: ConversionStream,
        staging: Path,
        names: ShardNames,
        state: RunState,
        step: Callable[[int], None],
    ) -> None:
        self._stream, self._staging, self._names = stream, staging, names
        self._state, self._step = state, step
        self._open = ExitStack()
        self._index: int | None = None
        self._file: StreamedSafetensors | None = None

    def __enter__(self) -> _ShardFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            self._open.__exit__(kind, *exc)  # type: ignore[arg-type]
        else:
            self._finish()

    def add(self, index: int, tensors: Written) -> None:
        if index != self._index:
            self._finish()
            self._start(index)
        assert self._file is not None
        for name, tensor in tensors.items():
            self._file.add(name, tensor)

    def _start(self, index: int) -> None:
        shard = self._stream.work.shards[index]
        room = header_room(shard, entries_per_name=_MAX_PACKED_TENSORS)
        path = self._staging / self._names.name(index)
        self._file = self._open.enter_context(streamed_safetensors(path, room))
        self._index = index

    def _finish(self) -> None:
        if self._index is None:
            return
        self._open.close()
        self._state.record({"shard": self._names.name(self._index)}, None)
        self._step(len(self._stream.work.shards[self._index]))
        self._index, self._file = None, None
