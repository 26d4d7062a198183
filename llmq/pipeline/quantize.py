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
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmq.calib.collect import run_observed
from llmq.calib.experts import take_routed_tokens
from llmq.calib.hooks import InputQuantization
from llmq.calib.precision import tensor_float32
from llmq.calib.stats import CalibStats, InputStats
from llmq.calib.stream import LayerStream, kv_hook
from llmq.calib.walk import StreamedLayer
from llmq.config import RESUME_EVERY_S, Recipe
from llmq.errors import InputError
from llmq.heap import ReusedBuffers
from llmq.io.atomic import publish, save_safetensors, staging_path
from llmq.io.checkpoint import Checkpoint, torch_dtype
from llmq.io.discover import describe_layout
from llmq.io.layout import DecoderLayout
from llmq.io.record import OutputRecord
from llmq.pack.format import scheme_format
from llmq.pipeline.linears import (
    REPORT_WINDOWS,
    LayerDone,
    check_finite,
    compared_with_baseline,
    quantize_linears,
    relative_rmse,
    rtn_layer_error,
    rtn_linear_errors,
    rtn_weights,
    run_quantized,
)
from llmq.pipeline.output import (
    ShardNames,
    finalize,
    non_layer_tensors,
    other_layer_tensors,
    weights_size,
)
from llmq.pipeline.plan import LinearPlan, Plan
from llmq.pipeline.report import LayerReport, QuantizeResult, layer_report, written_sparsity
from llmq.pipeline.scaling import ScaleReport, apply_awq, apply_smoothquant
from llmq.pipeline.staged import StagedLayer, keeps_activations, stages_in_layer
from llmq.pipeline.state import RunState, load_state
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.kvcache import KVQuantizer, KVRange
from llmq.quant.masks import Sparsity
from llmq.quant.methods import Method, get_method
from llmq.quant.observers import observe_scale

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
) -> QuantizeResult:
    """Quantize (or prune) every decoder layer of `ckpt` as `plan` says and publish the
    checkpoint at `out`. `layer_sparsities`: a pruning method's share per layer (a sparsity
    profile), instead of the recipe's everywhere. `stage_activations`: whether a staged layer keeps
    its blocks' activations ("keep", "recompute" or "auto": `keeps_activations`). `tf32`: the
    layers' matrix products in TF32 on a GPU (`tensor_float32`)."""
    started = time.perf_counter()
    staging = staging_path(out)
    fingerprint = {"recipe": recipe.model_dump(mode="json"), "source": ckpt.file_stamps()}
    state = load_state(staging, fingerprint, resume_every_s) if resume else None
    if state is None:
        if resume:
            log.warning("%s: no interrupted run to resume; starting from the first layer", out)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        state = RunState(staging, fingerprint, every_s=resume_every_s)
    resumed = state.done
    method = get_method(recipe)
    tokens = recipe.calibration.moe_calibration if recipe.calibration else "all"
    stream = LayerStream(ckpt, device=device, expert_tokens=tokens)
    shards = ShardNames.per_layer(ckpt.num_layers)
    if resumed == 0:
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
            save_safetensors(staging / shards.name(layer.index + 1), tensors)
            state.record(asdict(report), output)
    del buffers
    if method.sparsity is not None:
        record.sparsity = written_sparsity(state.layers)
    with progress.stage("writing config, index and the reference for `llmq verify`"):
        finalize(ckpt, plan, recipe, staging, shards, record, device, reference=reference)
    publish(staging, out)
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
    )


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
            done = _quantize_observed(
                stream, layer.module, local, method, recipe, hidden, calib_stats, prefix,
                lambda: step(1),
            )  # fmt: skip
    if done.output is not None:
        check_finite(done.output, f"the output of layer {index}")
    tensors = {f"{prefix}{key}": value for key, value in done.tensors.items()}
    tensors.update(other_layer_tensors(stream.ckpt, layer.module, prefix, local))
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


def _quantize_observed(
    stream: LayerStream,
    layer: nn.Module,
    local: dict[str, LinearPlan],
    method: Method,
    recipe: Recipe,
    hidden: Tensor | None,
    calib_stats: CalibStats | None,
    prefix: str,
    on_batch: Callable[[], Any],
) -> LayerDone:
    """Observe the float layer's inputs of all linears in one pass, quantize them (after AWQ's
    or SmoothQuant's scales, when asked), then run the layer again quantized."""
    reference, observed, output, rtn_error = None, {}, None, None
    attention = layer.get_submodule(stream.layout.attention)
    kv_range = KVRange() if recipe.kv_cache_args is not None else None
    if hidden is not None:
        with kv_hook(attention, kv_range):
            reference, observed = run_observed(
                stream, layer, list(local), hidden, hessian=method.needs_hessian,
                norms=method.needs_norms,
                samples=_needs_samples(recipe), on_batch=on_batch, keep=REPORT_WINDOWS,
            )  # fmt: skip
    expert_tokens = take_routed_tokens(layer) if hidden is not None else None
    stats = {name: _stats_for(calib_stats, observed, prefix, name) for name in local}
    kv = _kv_quantization(recipe, kv_range, local)
    rtn_errors: dict[str, float | None] = {}
    if reference is not None and compared_with_baseline(method, recipe.weight_args is None):
        rtn_errors, rtn_error = _compare_with_rtn(
            stream, layer, local, stats, _input_quantization(local, stats, recipe), kv, hidden,
            reference, on_batch, method.sparsity,
        )  # fmt: skip
    stats, scale_reports = _equivalence_scaling(stream, layer, local, recipe, method, stats)
    tensors, linear_reports = quantize_linears(
        layer, local, stats, method, scheme_format(recipe.scheme), rtn_errors
    )
    inputs = _input_quantization(local, stats, recipe)
    error = None
    if reference is not None:  # the inputs are spent: the outputs take their place
        output = run_quantized(stream, layer, inputs, kv, hidden, on_batch, in_place=True)
        error = relative_rmse(output[:REPORT_WINDOWS], reference)
    tensors.update(_scale_tensors(inputs, kv, stream.layout.attention))
    return LayerDone(
        tensors, linear_reports, output, error, rtn_error, scale_reports, expert_tokens
    )


def _needs_samples(recipe: Recipe) -> bool:
    """Sample rows feed SmoothQuant's error measurement and the percentile/mse observers."""
    return recipe.smooth is not None or recipe.observer != "absmax"


def _equivalence_scaling(
    stream: LayerStream,
    layer: nn.Module,
    local: dict[str, LinearPlan],
    recipe: Recipe,
    method: Method,
    stats: dict[str, InputStats | None],
) -> tuple[dict[str, InputStats | None], list[ScaleReport]]:
    """AWQ's or SmoothQuant's scales, folded into the layer (at most one of them: the recipe
    refuses both); the consumers' statistics after scaling."""
    args = {name: linear.args for name, linear in local.items()}
    dtypes = {name: torch_dtype(linear.dtype) for name, linear in local.items()}
    if method.awq is not None:
        return apply_awq(layer, stream.layout_of(layer), args, dtypes, stats, method.awq)
    if recipe.smooth is not None:
        inputs = {name: lin.input_args for name, lin in local.items() if lin.input_args}
        layout = stream.layout_of(layer)
        return apply_smoothquant(layer, layout, args, dtypes, inputs, stats, recipe.smooth)
    return stats, []


def _input_quantization(
    local: dict[str, LinearPlan], stats: dict[str, InputStats | None], recipe: Recipe
) -> dict[str, InputQuantization]:
    """How each linear's input is quantized in the quantized pass and on disk: dynamic args, or
    static args with the scale the observer picks on the (scaled) calibration inputs."""
    inputs: dict[str, InputQuantization] = {}
    for name, linear in local.items():
        args = linear.input_args
        if args is None:
            continue
        scale = None
        if not args.dynamic:
            observed = stats[name]
            if observed is None:
                raise InputError(f"{linear.name}: static input scales need calibration data")
            scale = observe_scale(
                observed.absmax, observed.samples, args, recipe.observer,
                scale_dtype=torch_dtype(linear.dtype),
            )  # fmt: skip
        inputs[name] = (args, scale)
    return inputs


def _kv_quantization(
    recipe: Recipe, kv_range: KVRange | None, local: dict[str, LinearPlan]
) -> KVQuantizer | None:
    """The layer's KV cache quantizer, from the keys and values observed on the float layer."""
    args = recipe.kv_cache_args
    if args is None or kv_range is None:
        return None
    dtype = torch_dtype(next(iter(local.values())).dtype) if local else torch.float32
    return KVQuantizer(args, **kv_range.scales(args, dtype))


def _scale_tensors(
    inputs: dict[str, InputQuantization], kv: KVQuantizer | None, attention: str
) -> dict[str, Tensor]:
    """input_scale of static inputs and k_scale / v_scale, as compressed-tensors names them."""
    tensors = {
        f"{name}.input_scale": scale for name, (_, scale) in inputs.items() if scale is not None
    }
    if kv is not None:
        tensors[f"{attention}.k_scale"] = kv.k_scale
        tensors[f"{attention}.v_scale"] = kv.v_scale
    return tensors


def _batches(stream: LayerStream, hidden: Tensor) -> int:
    return len(list(stream.batches(hidden)))


def _compare_with_rtn(
    stream: LayerStream,
    layer: nn.Module,
    local: dict[str, LinearPlan],
    stats: dict[str, InputStats | None],
    inputs: dict[str, InputQuantization],
    kv: KVQuantizer | None,
    hidden: Tensor,
    reference: Tensor,
    on_batch: Callable[[], Any],
    sparsity: Sparsity | None,
) -> tuple[dict[str, float | None], float]:
    """What the data-free baseline would give (`rtn_weights`): each linear's output error, and
    the layer's output error on the reference windows (its copy of the layer is dropped on
    return)."""
    rtn = rtn_weights(layer, local, sparsity)
    errors = rtn_linear_errors(layer, rtn, stats)
    return errors, rtn_layer_error(stream, layer, rtn, inputs, kv, hidden, reference, on_batch)


def _stats_for(
    calib_stats: CalibStats | None, observed: dict[str, InputStats], prefix: str, name: str
) -> InputStats | None:
    """The linear's input statistics: from --calib-stats when given (with this run's sample
    rows, which files do not hold), else as observed in this run."""
    own = observed.get(name)
    if calib_stats is None:
        return own
    try:
        stats = calib_stats.inputs[prefix + name]
    except KeyError:
        raise InputError(
            f"--calib-stats has no statistics for {prefix + name}",
            hint="collect them with `llmq calibrate` on this model",
        ) from None
    if stats.samples is None and own is not None and own.samples is not None:
        return replace(stats, samples=own.samples)
    return stats
