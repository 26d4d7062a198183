"""The layer pipeline: embeddings once, then one decoder layer at a time.

For each layer: load it from the shards, quantize its linears with the chosen method on the
calibration batch, keep the quantized layer's output (activations quantized too, when the
scheme says so) as the next layer's input, write its packed tensors, and record it for
--resume. The report compares the layer's output with the full-precision layer's, and with
plain RTN's, on the first REPORT_WINDOWS windows.

Two schedules inside a layer. Methods that only need their own Hessians (GPTQ, unless
--no-true-sequential) quantize group by group, each group observed on the outputs of the
groups before it, already quantized: about one forward pass per layer; peak memory is one
layer plus 2 + intermediate/hidden copies of the activations. The others (AWQ, SmoothQuant,
static activation scales, KV cache) observe the full-precision layer whole, quantize, then run
it again quantized: two passes; peak memory is one layer plus one copy of the activations.
Both are independent of the model's depth.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import Tensor

from llmq.calib.precision import tensor_float32
from llmq.calib.stats import CalibStats
from llmq.calib.stream import LayerStream
from llmq.calib.walk import StreamedLayer
from llmq.config import RESUME_EVERY_S, Recipe
from llmq.heap import ReusedBuffers
from llmq.io.atomic import publish, save_safetensors, staging_path
from llmq.io.checkpoint import Checkpoint
from llmq.io.discover import describe_layout
from llmq.io.fused_experts import fuse_experts
from llmq.io.layout import DecoderLayout
from llmq.io.record import OutputRecord
from llmq.mixed.choose import written_bits
from llmq.pipeline.linears import (
    REPORT_WINDOWS,
    check_finite,
)
from llmq.pipeline.observed import quantize_observed
from llmq.pipeline.output import (
    ShardNames,
    finalize,
    non_layer_tensors,
    other_layer_tensors,
    weights_size,
)
from llmq.pipeline.plan import LinearPlan, Plan
from llmq.pipeline.report import LayerReport, QuantizeResult, layer_report, written_sparsity
from llmq.pipeline.staged import StagedLayer, keeps_activations, stages_in_layer
from llmq.pipeline.state import RunState, load_state
from llmq.processes import SINGLE_PROCESS, Processes
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.masks import Sparsity
from llmq.quant.methods import Method, get_method

log = logging.getLogger(__name__)


def run_quantization(
    ckpt: Checkpoint,
    plan: Plan,
    recipe: Recipe,
    out: Path,
    *,
    calibration_ids: Tensor | None,
    calib_stats: CalibStats | None,
    resume: bool,
    progress: Progress = NO_PROGRESS,
    record: OutputRecord,
    device: str | None = None,
    resume_every_s: float = RESUME_EVERY_S,
    reference: bool = True,
    layer_sparsities: list[float] | None = None,
    stage_activations: str = "auto",
    tf32: bool = True,
    processes: Processes = SINGLE_PROCESS,
) -> QuantizeResult:
    """Quantize (or prune) every decoder layer of `ckpt` as `plan` says and publish the
    checkpoint at `out`. `layer_sparsities`: a pruning method's share per layer (a sparsity
    profile), instead of the recipe's everywhere. `stage_activations`: whether a staged layer keeps
    its blocks' activations ("keep", "recompute" or "auto": `keeps_activations`). `tf32`: the
    layers' matrix products in TF32 on a GPU (`tensor_float32`). `processes`: torchrun's, each
    with its share of `calibration_ids`; the statistics are reduced over them, the layer's
    solves shared out, and process 0 writes."""
    started = time.perf_counter()
    staging = staging_path(out)
    state = _run_state(ckpt, recipe, staging, resume, resume_every_s, processes)
    resumed = state.done
    method = get_method(recipe)
    tokens = recipe.calibration.moe_calibration if recipe.calibration else "all"
    stream = LayerStream(ckpt, device=device, expert_tokens=tokens, processes=processes)
    shards = ShardNames.per_layer(ckpt.num_layers)
    if resumed == 0 and processes.is_main:
        save_safetensors(staging / shards.name(0), non_layer_tensors(ckpt))
    walk = stream.walk(
        _initial_hidden(stream, state, calibration_ids),
        start=resumed,
        progress=progress,
        label="pruning layers" if recipe.weight_args is None else "quantizing layers",
    )
    buffers = ReusedBuffers()  # captured and kept activations, layer after layer
    with tensor_float32(tf32):
        for layer in walk:
            layer_method = method
            if layer_sparsities is not None:
                sparsity = Sparsity(fraction=layer_sparsities[layer.index])
                layer_method = replace(method, sparsity=sparsity)  # type: ignore[type-var]
            report, output, tensors = _quantize_layer(
                stream, layer, plan.layers[layer.index], recipe, layer_method, calib_stats, progress,
                buffers, stage_activations,
            )  # fmt: skip
            layer.advance(output)
            if processes.is_main:
                save_safetensors(staging / shards.name(layer.index + 1), tensors)
            state.record(asdict(report), output)
    del buffers
    if method.sparsity is not None:
        record.sparsity = written_sparsity(state.layers)

    def publish_checkpoint() -> None:
        if record.mixed_precision is not None:  # counted from the files as written
            record.mixed_precision["written_bits"] = written_bits(staging, ckpt)
        with progress.stage("writing config, index and the reference for `llmq verify`"):
            finalize(ckpt, plan, recipe, staging, shards, record, device, reference=reference)
        publish(staging, out)

    processes.on_main(publish_checkpoint)
    return QuantizeResult(
        out_dir=out,
        model=str(ckpt.path),
        scheme=recipe.scheme.name,
        method=recipe.method,
        layers=[layer_report(raw) for raw in state.layers],
        ignored=plan.ignored,
        group_size_adjustments=[asdict(a) for a in plan.adjustments],
        calibration=record.calibration,
        fallback=record.fallback,
        loaders=record.loaders or {},
        resumed_layers=resumed,
        seconds=time.perf_counter() - started,
        size_bytes={"source": weights_size(ckpt.path), "output": weights_size(out)},
        sparsity=record.sparsity,
        discovered_layout=describe_layout(ckpt.layout) if ckpt.layout.discovered else None,
        mixed_precision=record.mixed_precision,
    )


def _run_state(
    ckpt: Checkpoint,
    recipe: Recipe,
    staging: Path,
    resume: bool,
    every_s: float,
    processes: Processes,
) -> RunState:
    """The interrupted run's state to continue (with --resume, the same recipe, source and
    processes), or a fresh staging folder (made by process 0, before any process goes on)."""
    fingerprint = {"recipe": recipe.model_dump(mode="json"), "source": ckpt.file_stamps()}
    if processes.distributed:  # each process's windows, and resume points, are its own
        fingerprint["processes"] = processes.world_size
    state = load_state(staging, fingerprint, every_s, processes) if resume else None
    if state is None:
        if resume:
            log.warning("%s: no interrupted run to resume; starting from the first layer", staging)
        if processes.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        processes.barrier()
        state = RunState(staging, fingerprint, every_s=every_s, processes=processes)
    return state


def _initial_hidden(stream: LayerStream, state: RunState, ids: Tensor | None) -> Tensor | None:
    if ids is None:
        return None
    if state.done:
        hidden = state.hidden()
        return None if hidden is None else hidden.to(stream.device)
    return stream.embed(ids)


@torch.inference_mode()  # no autograd bookkeeping: ~20% of GPTQ's per-column loop on a CPU
def _quantize_layer(
    stream: LayerStream,
    layer: StreamedLayer[Tensor | None],
    linears: list[LinearPlan],
    recipe: Recipe,
    method: Method,
    calib_stats: CalibStats | None,
    progress: Progress,
    buffers: ReusedBuffers,
    stage_activations: str,
) -> tuple[LayerReport, Tensor | None, dict[str, Tensor]]:
    """The layer quantized: its report, its output (the next layer's input) and its tensors."""
    index, prefix, hidden = layer.index, layer.prefix, layer.hidden
    local = {linear.name[len(prefix) :]: linear for linear in linears}
    staged = hidden is not None and stages_in_layer(stream, recipe, method, calib_stats, local)
    passes = _passes(stream, stream.layout_of(layer.module), method, hidden, staged=staged)
    with progress.stage(f"layer {index}", total=passes, transient=True) as step:
        if staged:
            assert hidden is not None
            keep = keeps_activations(stage_activations, stream, layer.module, hidden, buffers)
            done = StagedLayer(
                stream, layer.module, local, method, recipe, hidden, lambda: step(1), buffers,
                keep=keep,
            ).run()  # fmt: skip
        else:
            done = quantize_observed(
                stream, layer.module, local, method, recipe, hidden, calib_stats, prefix,
                lambda: step(1),
            )  # fmt: skip
    if done.output is not None:
        check_finite(done.output, f"the output of layer {index}")
    tensors = {f"{prefix}{key}": value for key, value in done.tensors.items()}
    tensors.update(other_layer_tensors(stream.ckpt, layer.module, prefix, local))
    tensors = fuse_experts(tensors, stream.layout_of(layer.module), prefix)
    report = LayerReport(
        index, done.error, time.perf_counter() - layer.started, done.linears, done.rtn_error,
        done.scales, done.expert_tokens,
    )  # fmt: skip
    return report, done.output, tensors


def _passes(
    stream: LayerStream,
    layout: DecoderLayout,
    method: Method,
    hidden: Tensor | None,
    *,
    staged: bool,
) -> int:
    """Micro-batches a layer runs (its progress bar's total)."""
    if hidden is None:
        return 0
    report = _batches(stream, hidden[:REPORT_WINDOWS]) if method.name != "rtn" else 0
    if staged:  # the reference, each group's stage, the output
        groups = len(layout.sequential)
        return (
            report
            + _batches(stream, hidden[:REPORT_WINDOWS])
            + (groups + 1) * _batches(stream, hidden)
        )
    return 2 * _batches(stream, hidden) + report


def _batches(stream: LayerStream, hidden: Tensor) -> int:
    return len(list(stream.batches(hidden)))
