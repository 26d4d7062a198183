"""The observe-then-quantize schedule of a layer: the float layer's inputs of all linears
observed in one pass, the linears quantized (after AWQ's or SmoothQuant's scales, with static
activation scales and a KV cache quantizer where the recipe asks), then the layer run again
quantized. What methods that read all groups' statistics at once need (the other schedule is
`llmq.pipeline.staged`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from llmq.calib.collect import run_observed
from llmq.calib.experts import take_routed_tokens
from llmq.calib.hooks import InputQuantization
from llmq.calib.stats import CalibStats, InputStats
from llmq.calib.stream import LayerStream, kv_hook
from llmq.config import Recipe
from llmq.errors import InputError
from llmq.io.checkpoint import torch_dtype
from llmq.pack.format import input_scale_name, scheme_format
from llmq.pipeline.linears import (
    REPORT_WINDOWS,
    LayerDone,
    compared_with_baseline,
    quantize_linears,
    relative_rmse,
    rtn_layer_error,
    rtn_linear_errors,
    rtn_weights,
    run_quantized,
)
from llmq.pipeline.plan import LinearPlan
from llmq.pipeline.scaling import ScaleReport, apply_awq, apply_smoothquant
from llmq.quant.kvcache import KVQuantizer, KVRange
from llmq.quant.masks import Sparsity
from llmq.quant.methods import Method
from llmq.quant.observers import observe_scale


def quantize_observed(
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
    if expert_tokens is not None:  # all processes' tokens
        expert_tokens = [sum(n) for n in zip(*stream.processes.gather(expert_tokens), strict=True)]
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
        layer, local, stats, method, scheme_format(recipe.scheme), rtn_errors,
        stream.layout_of(layer), stream.processes,
    )  # fmt: skip
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
        if args.dynamic is not True:  # static, or NVFP4's calibrated global scale
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
    """input_scale of static inputs (NVFP4's input_global_scale) and k_scale / v_scale, as
    compressed-tensors names them."""
    tensors = {
        f"{name}.{input_scale_name(args)}": scale
        for name, (args, scale) in inputs.items()
        if scale is not None
    }
    if kv is not None:
        tensors[f"{attention}.k_scale"] = kv.k_scale
        tensors[f"{attention}.v_scale"] = kv.v_scale
    return tensors


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
