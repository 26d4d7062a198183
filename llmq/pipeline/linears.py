"""Quantize one layer's linears and measure what it cost: the method on each linear (linears
that read one input stacked by rows), the on-disk tensors, and the output errors the report
compares with plain RTN's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from llmq.calib.hooks import InputQuantization, activation_quantization
from llmq.calib.stats import InputStats
from llmq.calib.stream import LayerStream, kv_hook
from llmq.errors import NumericalError
from llmq.io.checkpoint import torch_dtype
from llmq.io.layout import DecoderLayout
from llmq.pack.format import PackFormat, compress, weight_format
from llmq.pipeline.plan import LinearPlan
from llmq.pipeline.report import LinearReport
from llmq.pipeline.scaling import ScaleReport
from llmq.processes import SINGLE_PROCESS, Processes, attempt
from llmq.quant.awq import output_error
from llmq.quant.kvcache import KVQuantizer
from llmq.quant.masks import Sparsity, magnitude_scores, pruned_mask
from llmq.quant.methods import RTN, Method, MethodResult
from llmq.quant.primitives import ROW_STRATEGIES
from llmq.quant.rtn import rtn_quantize_weight

log = logging.getLogger(__name__)
# The layer-output errors (the method's, and plain RTN's for comparison) are measured on the
# first windows: enough for a comparison (4 x 512 tokens for the default calibration: on the
# default model's first layers, within 2.4% of the errors on 16 windows), and a fraction of the
# activations' memory and of a pass (1/32 of one for the default 128 windows, one micro-batch).
REPORT_WINDOWS = 4


@dataclass(slots=True)
class LayerDone:
    tensors: dict[str, Tensor]  # on-disk tensors, named relative to the layer
    linears: list[LinearReport]
    output: Tensor | None  # the layer's quantized output: the next layer's input
    error: float | None = None  # LayerReport.output_rel_rmse
    rtn_error: float | None = None
    scales: list[ScaleReport] = field(default_factory=list)
    expert_tokens: list[int] | None = None  # LayerReport.expert_tokens


def quantize_linears(
    layer: nn.Module,
    local: dict[str, LinearPlan],
    stats: dict[str, InputStats | None],
    method: Method,
    fmt: PackFormat,
    rtn_errors: dict[str, float | None],
    layout: DecoderLayout,
    processes: Processes = SINGLE_PROCESS,
) -> tuple[dict[str, Tensor], list[LinearReport]]:
    """Quantize each linear, put its dequantized weight back for the quantized pass, and return
    its on-disk tensors (names relative to the layer). The stacks are solved by `processes` in
    turn (their statistics are the same in each), and every process takes every result."""
    tensors: dict[str, Tensor] = {}
    reports = []
    results = {}
    stacks = _stacks(local, stats, fused_sets(layout))

    def solve(names: list[str]) -> list[MethodResult]:
        weights = [layer.get_submodule(name).weight.data for name in names]
        return _quantize_stack(method, weights, [local[name] for name in names], stats[names[0]])

    # each process solves its share of the stacks, then all share every result
    world, rank = processes.world_size, processes.rank
    solved = {i: attempt(partial(solve, names)) for i, names in enumerate(stacks) if i % world == rank}  # fmt: skip
    device = next(layer.parameters()).device
    for i, names in enumerate(stacks):
        parts = processes.shared(solved.get(i), i % world, device)
        results.update(zip(names, parts, strict=True))
    for name, linear in local.items():
        module = layer.get_submodule(name)
        weight = module.weight.data
        result = results[name]
        dequantized = result.weight.dequantize(weight.dtype)
        check_finite(dequantized, f"the {'pruned' if linear.args is None else 'quantized'} weights of {linear.name}")  # fmt: skip
        delta = dequantized - weight
        nrmse = float(delta.double().norm() / weight.double().norm().clamp_min(1e-30))
        reports.append(
            LinearReport(
                linear.name, linear.label, nrmse,
                output_error=linear_output_error(delta, weight, stats[name]),
                rtn_output_error=rtn_errors.get(name),
                loss=result.loss, dampening_frac=result.dampening_frac, warning=result.warning,
                sparsity=float((dequantized == 0).sum()) / dequantized.numel(),
                numel=dequantized.numel(),
            )
        )  # fmt: skip
        module.weight.data = dequantized
        for suffix, tensor in compress(result.weight, weight_format(linear.args, fmt)).items():
            tensors[f"{name}.{suffix}"] = tensor.cpu()
    return tensors, reports


def fused_sets(layout: DecoderLayout) -> dict[str, int]:
    """Each linear's set of the linears that read one input and that vLLM fuses into one
    (q/k/v; an expert's gate and up), by index; NVFP4 gives such a set one global scale, which
    vLLM requires of a fused linear."""
    groups = layout.expert_groups_split().sequential
    return {name: index for index, group in enumerate(groups) for name in group}


def _stacks(
    local: dict[str, LinearPlan], stats: dict[str, InputStats | None], fused: dict[str, int]
) -> list[list[str]]:
    """The linears grouped into weights quantized as one, stacked by rows: those that read one
    input (q/k/v, gate/up: one statistics object) with the same arguments and dtype, when their
    scales are per row. Methods treat rows independently, so the codes are the same; GPTQ then
    runs its per-column loop once for q/k/v instead of three times (2x faster here). NVFP4
    weights stack by `fused` set, whether calibrated or not: the stack's one global scale is
    the set's."""
    stacks: dict[object, list[str]] = {}
    rows: dict[object, int] = {}
    for name, linear in local.items():
        rows_apart = linear.args is None or linear.args.strategy in ROW_STRATEGIES
        stackable = stats[name] is not None and rows_apart
        key: object = (id(stats[name]), linear.args, linear.dtype) if stackable else name
        if linear.args is not None and linear.args.strategy == "tensor_group":
            key = ("global scale", fused.get(name, name), linear.args, linear.dtype)
        if rows.get(key, 0) + linear.out_features > MAX_STACKED_ROWS and key in stacks:
            stacks[(key, len(stacks))] = stacks.pop(key)  # full: later linears start anew
            rows[key] = 0
        stacks.setdefault(key, []).append(name)
        rows[key] = rows.get(key, 0) + linear.out_features
    return list(stacks.values())


# A stack's rows at most: all experts of a mixture share one input (128 experts of Qwen3-235B:
# 393,216 gate/up rows, 6.4 GB in float32), and one stack is copied several times over while
# it is solved. No dense family comes near it (Llama-3-70B's gate/up: 57,344 rows).
MAX_STACKED_ROWS = 65_536


def _quantize_stack(
    method: Method, weights: list[Tensor], linears: list[LinearPlan], stats: InputStats | None
) -> list[MethodResult]:
    """The method on linears stacked by rows, one result each; numerical trouble is named and a
    raised dampening warned."""
    names = ", ".join(linear.name for linear in linears)
    stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
    unreached = stats is None and (method.needs_hessian or method.needs_norms)
    if unreached:  # an expert the router sent no calibration token (--moe-calibration routed)
        method = RTN(sparsity=method.sparsity)
    try:
        result = method.quantize_weight(
            stacked, linears[0].args, stats, scale_dtype=torch_dtype(linears[0].dtype)
        )
    except NumericalError as exc:
        raise NumericalError(f"{names}: {exc.message}", hint=exc.hint) from None
    if unreached:
        result = replace(result, warning="no calibration token reached it: rounded to nearest")
    if result.warning:
        log.warning("%s: %s", names, result.warning)
    return [result] if len(weights) == 1 else result.split_rows([len(w) for w in weights])


def linear_output_error(delta: Tensor, weight: Tensor, stats: InputStats | None) -> float | None:
    """||ΔW X|| / ||W X|| on the calibration inputs, when their Hessian was collected."""
    if stats is None or stats.hessian is None:
        return None
    reference = float(output_error(weight, stats.hessian))
    return (float(output_error(delta, stats.hessian)) / max(reference, 1e-30)) ** 0.5


def compared_with_baseline(method: Method, pruning_alone: bool) -> bool:
    """Whether the report shows the data-free baseline's errors beside the method's: plain RTN
    when quantizing, magnitude when pruning alone; not when the method is that baseline."""
    return method.name != ("magnitude" if pruning_alone else "rtn")


def rtn_weights(
    layer: nn.Module, local: dict[str, LinearPlan], sparsity: Sparsity | None
) -> dict[str, Tensor]:
    """Each linear's weight under the data-free baseline the report compares with: plain RTN
    (dequantized) when quantizing, magnitude pruning at the same sparsity when pruning alone."""
    rtn = {}
    for name, linear in local.items():
        weight = layer.get_submodule(name).weight.data
        if linear.args is None:
            assert sparsity is not None
            rtn[name] = weight.masked_fill(pruned_mask(magnitude_scores(weight), sparsity), 0)
            continue
        q = rtn_quantize_weight(weight, linear.args, scale_dtype=torch_dtype(linear.dtype))
        rtn[name] = q.dequantize(weight.dtype)
    return rtn


def rtn_linear_errors(
    layer: nn.Module, rtn: dict[str, Tensor], stats: dict[str, InputStats | None]
) -> dict[str, float | None]:
    """Each linear's output error under plain RTN (before the method replaces its weight)."""
    errors = {}
    for name, quantized in rtn.items():
        weight = layer.get_submodule(name).weight.data
        errors[name] = linear_output_error(quantized - weight, weight, stats[name])
    return errors


def rtn_layer_error(
    stream: LayerStream,
    layer: nn.Module,
    rtn: dict[str, Tensor],
    inputs: dict[str, InputQuantization],
    kv: KVQuantizer | None,
    hidden: Tensor,
    reference: Tensor,
    on_batch: Callable[[], Any],
) -> float:
    """The layer's output error with plain RTN weights, on the reference windows (swapped into
    the layer's own modules and back: no second layer is built)."""
    originals: dict[str, Tensor] = {}
    for name, quantized in rtn.items():
        module = layer.get_submodule(name)
        originals[name] = module.weight.data
        module.weight.data = quantized
    try:
        output = run_quantized(stream, layer, inputs, kv, hidden[: len(reference)], on_batch)
    finally:
        for name, weight in originals.items():
            layer.get_submodule(name).weight.data = weight
    return relative_rmse(output, reference)


def run_quantized(
    stream: LayerStream,
    layer: nn.Module,
    inputs: dict[str, InputQuantization],
    kv: KVQuantizer | None,
    hidden: Tensor,
    on_batch: Callable[[], Any],
    *,
    in_place: bool = False,
) -> Tensor:
    """The layer's output with its linear inputs (and KV cache) quantized as the recipe says
    (written over `hidden` when `in_place`)."""
    attention = layer.get_submodule(stream.layout.attention)
    with activation_quantization(layer, inputs), kv_hook(attention, kv):
        return stream.run_layer(layer, hidden, on_batch=on_batch, in_place=in_place)


def relative_rmse(output: Tensor, reference: Tensor) -> float:
    """||output - reference|| / ||reference||, accumulated in float64 one window at a time (a
    float64 copy of whole activations would cost more memory than the layer itself)."""
    diff = ref = 0.0
    for got, want in zip(output, reference, strict=True):
        diff += float((got - want).double().pow(2).sum())
        ref += float(want.double().pow(2).sum())
    return (diff / max(ref, 1e-60)) ** 0.5


def check_finite(tensor: Tensor, what: str) -> None:
    """NaN or Inf anywhere shows in the extremes (NaN propagates through min and max): one
    reduction, 25x faster than `isfinite(tensor).all()` on a layer's activations, and without
    its temporaries (an abs() copy and two masks: +0.25 GB of peak RSS for the default model's
    151 MB of activations)."""
    if not all(torch.isfinite(extreme) for extreme in torch.aminmax(tensor)):
        raise NumericalError(
            f"NaN or Inf in {what}",
            hint="the source weights or activations may be corrupt; try --ignore for this layer",
        )
