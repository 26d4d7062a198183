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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmq.calib.collect import observe_until, run_observed
from llmq.calib.stats import CalibStats, InputStats
from llmq.calib.stream import (
    BlockOutput,
    InputQuantization,
    LayerStream,
    activation_quantization,
    kv_hook,
)
from llmq.config import RESUME_EVERY_S, Recipe
from llmq.errors import InputError, NumericalError
from llmq.heap import ReusedBuffers, reused_heap
from llmq.io.atomic import publish, save_safetensors, staging_path, write_json
from llmq.io.checkpoint import RECORD_FILE, Checkpoint, side_files, torch_dtype
from llmq.pack.format import PackFormat, compress, quantization_config, scheme_format
from llmq.pipeline.plan import LinearPlan, Plan, config_groups
from llmq.pipeline.scaling import ScaleReport, apply_awq, apply_smoothquant
from llmq.pipeline.state import HIDDEN_FILE, STATE_FILE, RunState, load_state
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.awq import output_error
from llmq.quant.kvcache import KVQuantizer, KVRange
from llmq.quant.methods import Method, MethodResult, get_method
from llmq.quant.observers import observe_scale
from llmq.quant.primitives import ROW_STRATEGIES
from llmq.quant.rtn import rtn_quantize_weight

log = logging.getLogger(__name__)
# The layer-output errors (the method's, and plain RTN's for comparison) are measured on the
# first windows: enough for a comparison (4 x 512 tokens for the default calibration: on the
# default model's first layers, within 2.4% of the errors on 16 windows), and a fraction of the
# activations' memory and of a pass (1/32 of one for the default 128 windows, one micro-batch).
REPORT_WINDOWS = 4


@dataclass(frozen=True, slots=True)
class LinearReport:
    name: str
    quant: str  # e.g. "int4 g64"
    weight_nrmse: float  # ||W - deq(q(W))|| / ||W||
    # ||(W - Q) X|| / ||W X|| on the calibration inputs, from their Hessian (methods that collect
    # one); for AWQ-scaled linears, of the scaled weight on the scaled inputs.
    output_error: float | None = None
    rtn_output_error: float | None = None  # the same for plain RTN of the original weight
    loss: float | None = None  # the method's own objective (GPTQ's loss)
    dampening_frac: float | None = None  # GPTQ's dampening, raised when Cholesky failed
    warning: str | None = None  # numerical trouble handled by a documented fallback


@dataclass(frozen=True, slots=True)
class LayerReport:
    index: int
    # ||Y_q - Y|| / ||Y|| on the first REPORT_WINDOWS calibration windows; None: no data
    output_rel_rmse: float | None
    seconds: float
    linears: list[LinearReport]
    # The same layer and inputs with plain RTN, on the same windows.
    rtn_output_rel_rmse: float | None = None
    scales: list[ScaleReport] = field(default_factory=list)  # AWQ's folds


@dataclass(slots=True)
class QuantizeResult:
    out_dir: Path
    model: str
    scheme: str
    method: str
    layers: list[LayerReport]
    ignored: list[str]
    group_size_adjustments: list[dict[str, Any]]
    calibration: dict[str, Any] | None
    fallback: dict[str, Any] | None = None  # linears a fallback scan kept in full precision
    # per loader (transformers, vllm, llmq): {"reads": bool, "why": str | None}
    loaders: dict[str, Any] = field(default_factory=dict)
    resumed_layers: int = 0
    seconds: float = 0.0
    size_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["out_dir"] = str(self.out_dir)
        return data


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
    record: dict[str, Any],
    device: str | None = None,
    resume_every_s: float = RESUME_EVERY_S,
) -> QuantizeResult:
    started = time.perf_counter()
    staging = staging_path(out)
    fingerprint = {"recipe": recipe.model_dump(mode="json"), "source": ckpt.file_stamps()}
    state = load_state(staging, fingerprint, resume_every_s) if resume else None
    if state is None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        state = RunState(staging, fingerprint, every_s=resume_every_s)
    resumed = state.done
    method = get_method(recipe)
    stream = LayerStream(ckpt, device=device)
    shards = _ShardNames(ckpt.num_layers)
    if resumed == 0:
        save_safetensors(staging / shards.name(0), _non_layer_tensors(ckpt))
    hidden = _initial_hidden(stream, state, calibration_ids)
    buffers = ReusedBuffers()  # captured and kept activations, layer after layer
    with (
        progress.stage("quantizing layers", total=ckpt.num_layers) as advance,
        reused_heap(),  # every op's output is a fresh tensor: 5-10% of a CPU layer was faults
    ):
        advance(resumed)
        for index in range(resumed, ckpt.num_layers):
            report, hidden, tensors = _quantize_layer(
                stream, index, plan.layers[index], recipe, method, hidden, calib_stats, progress,
                buffers,
            )  # fmt: skip
            save_safetensors(staging / shards.name(index + 1), tensors)
            state.record(asdict(report), hidden)
            advance(1)
    del buffers
    _finalize(ckpt, plan, recipe, staging, shards, record, device)
    publish(staging, out)
    return QuantizeResult(
        out_dir=out,
        model=str(ckpt.path),
        scheme=recipe.scheme.name,
        method=recipe.method,
        layers=[_layer_report(raw) for raw in state.layers],
        ignored=plan.ignored,
        group_size_adjustments=[asdict(a) for a in plan.adjustments],
        calibration=record.get("calibration"),
        fallback=record.get("fallback"),
        loaders=record.get("loaders", {}),
        resumed_layers=resumed,
        seconds=time.perf_counter() - started,
        size_bytes={"source": _weights_size(ckpt.path), "output": _weights_size(out)},
    )


def _layer_report(raw: dict[str, Any]) -> LayerReport:
    linears = [LinearReport(**linear) for linear in raw["linears"]]
    scales = [ScaleReport(**scale) for scale in raw.get("scales", [])]
    return LayerReport(**{**raw, "linears": linears, "scales": scales})


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
    index: int,
    linears: list[LinearPlan],
    recipe: Recipe,
    method: Method,
    hidden: Tensor | None,
    calib_stats: CalibStats | None,
    progress: Progress,
    buffers: ReusedBuffers,
) -> tuple[LayerReport, Tensor | None, dict[str, Tensor]]:
    started = time.perf_counter()
    prefix = stream.layout.layer_prefix(index)
    layer = stream.load_layer(index)
    local = {linear.name[len(prefix) :]: linear for linear in linears}
    staged = hidden is not None and _stages_in_layer(recipe, method, calib_stats, local)
    passes = _passes(stream, method, hidden, staged=staged)
    with progress.stage(f"layer {index}", total=passes, transient=True) as step:
        if staged:
            assert hidden is not None
            done = _StagedLayer(
                stream, layer, local, method, recipe, hidden, lambda: step(1), buffers
            ).run()
        else:
            done = _quantize_observed(
                stream, layer, local, method, recipe, hidden, calib_stats, prefix, lambda: step(1)
            )
    if done.output is not None:
        _check_finite(done.output, f"the output of layer {index}")
    tensors = {f"{prefix}{key}": value for key, value in done.tensors.items()}
    tensors.update(_other_layer_tensors(stream.ckpt, layer, prefix, local))
    report = LayerReport(
        index, done.error, time.perf_counter() - started, done.linears, done.rtn_error,
        done.scales,
    )  # fmt: skip
    return report, done.output, tensors


@dataclass(slots=True)
class _LayerDone:
    tensors: dict[str, Tensor]  # on-disk tensors, named relative to the layer
    linears: list[LinearReport]
    output: Tensor | None  # the layer's quantized output: the next layer's input
    error: float | None = None  # LayerReport.output_rel_rmse
    rtn_error: float | None = None
    scales: list[ScaleReport] = field(default_factory=list)


def _stages_in_layer(
    recipe: Recipe, method: Method, calib_stats: CalibStats | None, local: dict[str, LinearPlan]
) -> bool:
    """Whether the layer is quantized group by group (`_StagedLayer`): for methods that
    observe their own Hessians and quantize weights alone, unless the recipe turns it off.
    Scale searches (AWQ, SmoothQuant), KV cache and activation scales read the float layer's
    statistics of all groups at once."""
    return (
        recipe.gptq.true_sequential
        and calib_stats is None
        and method.needs_hessian
        and method.awq is None
        and recipe.smooth is None
        and recipe.kv_cache_args is None
        and all(linear.input_args is None for linear in local.values())
    )


def _passes(stream: LayerStream, method: Method, hidden: Tensor | None, *, staged: bool) -> int:
    """Micro-batches a layer runs (its progress bar's total)."""
    if hidden is None:
        return 0
    report = _batches(stream, hidden[:REPORT_WINDOWS]) if method.name != "rtn" else 0
    if staged:  # the reference, each group's stage, the output
        groups = len(stream.layout.sequential)
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
) -> _LayerDone:
    """Observe the float layer's inputs of all linears in one pass, quantize them (after AWQ's
    or SmoothQuant's scales, when asked), then run the layer again quantized."""
    reference, observed, output, rtn_error = None, {}, None, None
    attention = layer.get_submodule(stream.layout.attention)
    kv_range = KVRange() if recipe.kv_cache_args is not None else None
    if hidden is not None:
        with kv_hook(attention, kv_range):
            reference, observed = run_observed(
                stream, layer, list(local), hidden, hessian=method.needs_hessian,
                samples=_needs_samples(recipe), on_batch=on_batch, keep=REPORT_WINDOWS,
            )  # fmt: skip
    stats = {name: _stats_for(calib_stats, observed, prefix, name) for name in local}
    kv = _kv_quantization(recipe, kv_range, local)
    rtn_errors: dict[str, float | None] = {}
    if reference is not None and method.name != "rtn":  # report what plain RTN would give
        rtn_errors, rtn_error = _compare_with_rtn(
            stream, layer, local, stats, _input_quantization(local, stats, recipe), kv, hidden,
            reference, on_batch,
        )  # fmt: skip
    stats, scale_reports = _equivalence_scaling(stream, layer, local, recipe, method, stats)
    tensors, linear_reports = _quantize_linears(
        layer, local, stats, method, scheme_format(recipe.scheme), rtn_errors
    )
    inputs = _input_quantization(local, stats, recipe)
    error = None
    if reference is not None:  # the inputs are spent: the outputs take their place
        output = _run_quantized(stream, layer, inputs, kv, hidden, on_batch, in_place=True)
        error = _relative_rmse(output[:REPORT_WINDOWS], reference)
    tensors.update(_scale_tensors(inputs, kv, stream.layout.attention))
    return _LayerDone(tensors, linear_reports, output, error, rtn_error, scale_reports)


class _StagedLayer:
    """Quantize one layer group by group (GPTQ's true-sequential order inside a layer): each
    group of linears that share an input is observed on the output of the groups before it,
    already quantized, then quantized. The layer's output is written over `hidden`.

    It costs about one forward pass, against two for observe-then-propagate: each stage runs
    the layer only up to its group, blocks already quantized answer from their kept outputs,
    and the MLP's output projection runs once, in the last pass, on its kept inputs. The price
    is memory: the attention's output and the MLP's intermediate activations of all samples
    (2 + intermediate/hidden copies of the activations, with the layer's own input), held in
    `buffers` from layer to layer.
    """

    def __init__(
        self,
        stream: LayerStream,
        layer: nn.Module,
        local: dict[str, LinearPlan],
        method: Method,
        recipe: Recipe,
        hidden: Tensor,
        on_batch: Callable[[], Any],
        buffers: ReusedBuffers | None = None,
    ) -> None:
        self.stream, self.layer, self.local, self.method = stream, layer, local, method
        self.buffers = buffers or ReusedBuffers()
        self.fmt = scheme_format(recipe.scheme)
        self.hidden, self.on_batch = hidden, on_batch
        self.compare = method.name != "rtn"  # report what plain RTN would give
        self.kept: dict[str, BlockOutput] = {}  # blocks done: their outputs, by block
        self.done = _LayerDone({}, [], hidden)

    def run(self) -> _LayerDone:
        stream, layer, hidden = self.stream, self.layer, self.hidden
        reference = stream.run_layer(layer, hidden[:REPORT_WINDOWS], on_batch=self.on_batch)
        if self.compare:  # RTN's copy of the whole layer lives only for this pass
            self.done.rtn_error = _rtn_layer_error(
                stream, layer, _rtn_weights(layer, self.local), {}, None, hidden, reference,
                self.on_batch,
            )  # fmt: skip
        blocks = stream.layout.blocks
        for position, (block, groups) in enumerate(blocks):
            for group in groups[:-1]:
                self._quantize(group)
            projection_input = self._quantize(groups[-1], capture=True)
            assert projection_input is not None
            projection = layer.get_submodule(groups[-1][0])
            if position < len(blocks) - 1:  # later stages read it: computed once, kept
                output = self.buffers.take(
                    f"kept {block}", (*projection_input.shape[:-1], projection.weight.shape[0]),
                    projection_input,
                )  # fmt: skip
                self.kept[block] = _kept_output(stream, projection, projection_input, output)
            else:  # only the last pass reads it
                self.kept[block] = lambda rows, x=projection_input, p=projection: p(x[rows])
            del projection_input
        stream.run_layer(layer, hidden, on_batch=self.on_batch, in_place=True, replace=self.kept)
        self.done.error = _relative_rmse(hidden[:REPORT_WINDOWS], reference)
        return self.done

    def _quantize(self, group: tuple[str, ...], *, capture: bool = False) -> Tensor | None:
        """Observe the group's input on every sample (the layer run up to it), quantize its
        linears, and return its input when `capture` (a block's output projection). A group
        left entirely in full precision runs only to be captured."""
        names = [name for name in group if name in self.local]
        if not names and not capture:
            return None
        stats, captured = observe_until(
            self.stream, self.layer, names, self.hidden, names[0] if names else group[0],
            replace=self.kept, capture=capture, buffers=self.buffers, on_batch=self.on_batch,
        )  # fmt: skip
        part = {name: self.local[name] for name in names}
        errors: dict[str, float | None] = {}
        if self.compare:  # RTN's output error, from the weights the method is about to replace:
            # RTN runs again here (~20 ms a layer on the default model) rather than its copy of
            # the whole layer being held through every stage
            errors = _rtn_linear_errors(self.layer, _rtn_weights(self.layer, part), stats)
        tensors, reports = _quantize_linears(self.layer, part, stats, self.method, self.fmt, errors)
        self.done.tensors.update(tensors)
        self.done.linears.extend(reports)
        return captured


@torch.inference_mode()  # also when `_StagedLayer` runs outside `_quantize_layer` (tests)
def _kept_output(
    stream: LayerStream, projection: nn.Module, inputs: Tensor, output: Tensor
) -> BlockOutput:
    """A block's output, from its output projection on the kept inputs of all samples,
    written into `output`."""
    for rows in stream.batches(inputs):
        output[rows] = projection(inputs[rows])
    return lambda rows: output[rows]


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
        return apply_awq(layer, stream.layout, args, dtypes, stats, method.awq)
    if recipe.smooth is not None:
        inputs = {name: lin.input_args for name, lin in local.items() if lin.input_args}
        return apply_smoothquant(layer, stream.layout, args, dtypes, inputs, stats, recipe.smooth)
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
) -> tuple[dict[str, float | None], float]:
    """What plain RTN would give: each linear's output error, and the layer's output error on
    the reference windows (RTN's copy of the layer is dropped on return)."""
    rtn = _rtn_weights(layer, local)
    errors = _rtn_linear_errors(layer, rtn, stats)
    return errors, _rtn_layer_error(stream, layer, rtn, inputs, kv, hidden, reference, on_batch)


def _rtn_weights(layer: nn.Module, local: dict[str, LinearPlan]) -> dict[str, Tensor]:
    """Each linear's weight after plain RTN (dequantized): the comparison the report shows."""
    rtn = {}
    for name, linear in local.items():
        weight = layer.get_submodule(name).weight.data
        q = rtn_quantize_weight(weight, linear.args, scale_dtype=torch_dtype(linear.dtype))
        rtn[name] = q.dequantize(weight.dtype)
    return rtn


def _rtn_linear_errors(
    layer: nn.Module, rtn: dict[str, Tensor], stats: dict[str, InputStats | None]
) -> dict[str, float | None]:
    """Each linear's output error under plain RTN (before the method replaces its weight)."""
    errors = {}
    for name, quantized in rtn.items():
        weight = layer.get_submodule(name).weight.data
        errors[name] = _output_error(quantized - weight, weight, stats[name])
    return errors


def _rtn_layer_error(
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
        output = _run_quantized(stream, layer, inputs, kv, hidden[: len(reference)], on_batch)
    finally:
        for name, weight in originals.items():
            layer.get_submodule(name).weight.data = weight
    return _relative_rmse(output, reference)


def _run_quantized(
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


def _output_error(delta: Tensor, weight: Tensor, stats: InputStats | None) -> float | None:
    """||ΔW X|| / ||W X|| on the calibration inputs, when their Hessian was collected."""
    if stats is None or stats.hessian is None:
        return None
    reference = float(output_error(weight, stats.hessian))
    return (float(output_error(delta, stats.hessian)) / max(reference, 1e-30)) ** 0.5


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


def _quantize_linears(
    layer: nn.Module,
    local: dict[str, LinearPlan],
    stats: dict[str, InputStats | None],
    method: Method,
    fmt: PackFormat,
    rtn_errors: dict[str, float | None],
) -> tuple[dict[str, Tensor], list[LinearReport]]:
    """Quantize each linear, put its dequantized weight back for the quantized pass, and return
    its on-disk tensors (names relative to the layer)."""
    tensors: dict[str, Tensor] = {}
    reports = []
    results = {}
    for names in _stacks(local, stats):
        weights = [layer.get_submodule(name).weight.data for name in names]
        parts = _quantize_stack(method, weights, [local[name] for name in names], stats[names[0]])
        results.update(zip(names, parts, strict=True))
    for name, linear in local.items():
        module = layer.get_submodule(name)
        weight = module.weight.data
        result = results[name]
        _check_finite(result.weight.scale, f"the scales of {linear.name}")
        dequantized = result.weight.dequantize(weight.dtype)
        delta = dequantized - weight
        nrmse = float(delta.double().norm() / weight.double().norm().clamp_min(1e-30))
        reports.append(
            LinearReport(
                linear.name, linear.args.label, nrmse,
                output_error=_output_error(delta, weight, stats[name]),
                rtn_output_error=rtn_errors.get(name),
                loss=result.loss, dampening_frac=result.dampening_frac, warning=result.warning,
            )
        )  # fmt: skip
        module.weight.data = dequantized
        for suffix, tensor in compress(result.weight, fmt).items():
            tensors[f"{name}.{suffix}"] = tensor.cpu()
    return tensors, reports


def _stacks(local: dict[str, LinearPlan], stats: dict[str, InputStats | None]) -> list[list[str]]:
    """The linears grouped into weights quantized as one, stacked by rows: those that read one
    input (q/k/v, gate/up: one statistics object) with the same arguments and dtype, when their
    scales are per row. Methods treat rows independently, so the codes are the same; GPTQ then
    runs its per-column loop once for q/k/v instead of three times (2x faster here)."""
    stacks: dict[object, list[str]] = {}
    for name, linear in local.items():
        stackable = stats[name] is not None and linear.args.strategy in ROW_STRATEGIES
        key = (id(stats[name]), linear.args, linear.dtype) if stackable else name
        stacks.setdefault(key, []).append(name)
    return list(stacks.values())


def _quantize_stack(
    method: Method, weights: list[Tensor], linears: list[LinearPlan], stats: InputStats | None
) -> list[MethodResult]:
    """The method on linears stacked by rows, one result each; numerical trouble is named and a
    raised dampening warned."""
    names = ", ".join(linear.name for linear in linears)
    stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
    try:
        result = method.quantize_weight(
            stacked, linears[0].args, stats, scale_dtype=torch_dtype(linears[0].dtype)
        )
    except NumericalError as exc:
        raise NumericalError(f"{names}: {exc.message}", hint=exc.hint) from None
    if result.warning:
        log.warning("%s: %s", names, result.warning)
    return [result] if len(weights) == 1 else result.split_rows([len(w) for w in weights])


def _relative_rmse(output: Tensor, reference: Tensor) -> float:
    """||output - reference|| / ||reference||, accumulated in float64 one window at a time (a
    float64 copy of whole activations would cost more memory than the layer itself)."""
    diff = ref = 0.0
    for got, want in zip(output, reference, strict=True):
        diff += float((got - want).double().pow(2).sum())
        ref += float(want.double().pow(2).sum())
    return (diff / max(ref, 1e-60)) ** 0.5


def _check_finite(tensor: Tensor, what: str) -> None:
    """NaN or Inf anywhere shows in the extremes (NaN propagates through min and max): one
    reduction, 25x faster than `isfinite(tensor).all()` on a layer's activations, and without
    its temporaries (an abs() copy and two masks: +0.25 GB of peak RSS for the default model's
    151 MB of activations)."""
    if not all(torch.isfinite(extreme) for extreme in torch.aminmax(tensor)):
        raise NumericalError(
            f"NaN or Inf in {what}",
            hint="the source weights or activations may be corrupt; try --ignore for this layer",
        )


def _other_layer_tensors(
    ckpt: Checkpoint, layer: nn.Module, prefix: str, local: dict[str, LinearPlan]
) -> dict[str, Tensor]:
    """Tensors of the layer that are not quantized weights (norms, biases, ignored linears), in
    their stored dtype, from the module: AWQ may have folded scales into them."""
    quantized = {f"{prefix}{name}.weight" for name in local}
    state = layer.state_dict()
    return {
        name: state[name[len(prefix) :]].to(
            device="cpu", dtype=torch_dtype(ckpt.tensors[name].dtype)
        )
        for name in ckpt.names_with_prefix(prefix)
        if name not in quantized
    }


def _non_layer_tensors(ckpt: Checkpoint) -> dict[str, Tensor]:
    layers = ckpt.layout.layers + "."
    return {name: ckpt.read(name) for name in ckpt.tensors if not name.startswith(layers)}


class _ShardNames:
    """Shard 0 holds embeddings, final norm and lm_head; shard i + 1 holds decoder layer i."""

    def __init__(self, num_layers: int) -> None:
        self.total = num_layers + 1

    def name(self, shard: int) -> str:
        return f"model-{shard + 1:05d}-of-{self.total:05d}.safetensors"


def _finalize(
    ckpt: Checkpoint,
    plan: Plan,
    recipe: Recipe,
    staging: Path,
    shards: _ShardNames,
    record: dict[str, Any],
    device: str | None,
) -> None:
    from llmq.eval.logits import compute_reference, file_hashes
    from llmq.io.checkpoint import open_checkpoint, read_safetensors_header

    weight_map: dict[str, str] = {}
    total_size = 0
    for shard in range(shards.total):
        path = staging / shards.name(shard)
        for name in read_safetensors_header(path):
            weight_map[name] = path.name
        total_size += path.stat().st_size
    write_json(
        staging / "model.safetensors.index.json",
        {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
    )
    config = dict(ckpt.config)
    config["quantization_config"] = quantization_config(
        config_groups(plan), ignore=plan.ignored, fmt=scheme_format(recipe.scheme),
        kv_cache=recipe.kv_cache_args,
    )  # fmt: skip
    write_json(staging / "config.json", config)
    _copy_side_files(ckpt.path, staging)
    # What the written files compute, and their hashes, for `llmq verify`.
    record["reference"] = compute_reference(open_checkpoint(staging), device=device).to_dict()
    record["files"] = file_hashes(staging)
    write_json(staging / RECORD_FILE, record)
    (staging / STATE_FILE).unlink(missing_ok=True)
    (staging / HIDDEN_FILE).unlink(missing_ok=True)


def _copy_side_files(source: Path, staging: Path) -> None:
    """Tokenizer, generation config, chat template, license...: everything but weights and config."""
    for path in side_files(source):
        shutil.copy2(path, staging / path.name)


def _weights_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
