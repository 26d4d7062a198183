"""The layer pipeline: embeddings once, then one decoder layer at a time.

For each layer: load it from the shards, observe its linear inputs on the calibration batch
(full precision outputs kept as the reference), quantize its linears with the chosen method,
run it again quantized (activations too, when the scheme quantizes them) to get the next
layer's inputs and the layer's output error, write its packed tensors, and record it for
--resume. Peak memory is about one layer plus the activations, whatever the model size.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmq.calib.collect import run_observed
from llmq.calib.stats import CalibStats, InputStats
from llmq.calib.stream import LayerStream, activation_quantization
from llmq.config import Recipe
from llmq.errors import InputError, NumericalError
from llmq.io.atomic import publish, save_safetensors, staging_path, write_json
from llmq.io.checkpoint import Checkpoint
from llmq.pack.format import PackFormat, compress, quantization_config, scheme_format
from llmq.pipeline.plan import LinearPlan, Plan, config_groups
from llmq.pipeline.state import HIDDEN_FILE, STATE_FILE, RunState, load_state
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.methods import Method, get_method

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
RECORD_FILE = "llmq.json"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


@dataclass(frozen=True, slots=True)
class LinearReport:
    name: str
    quant: str  # e.g. "int4 g64"
    weight_nrmse: float  # ||W - deq(q(W))|| / ||W||


@dataclass(frozen=True, slots=True)
class LayerReport:
    index: int
    output_rel_rmse: float | None  # ||Y_q - Y|| / ||Y|| on the calibration batch; None: no data
    seconds: float
    linears: list[LinearReport]


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
) -> QuantizeResult:
    started = time.perf_counter()
    staging = staging_path(out)
    fingerprint = {"recipe": recipe.model_dump(mode="json"), "source": ckpt.file_stamps()}
    state = load_state(staging, fingerprint) if resume else None
    if state is None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        state = RunState(staging=staging, fingerprint=fingerprint)
    resumed = state.done
    method = get_method(recipe)
    stream = LayerStream(ckpt, device=device)
    shards = _ShardNames(ckpt.num_layers)
    if resumed == 0:
        save_safetensors(staging / shards.name(0), _non_layer_tensors(ckpt))
    hidden = _initial_hidden(stream, state, calibration_ids)
    with progress.stage("quantizing layers", total=ckpt.num_layers) as advance:
        advance(resumed)
        for index in range(resumed, ckpt.num_layers):
            report, hidden, tensors = _quantize_layer(
                stream, index, plan.layers[index], recipe, method, hidden, calib_stats, progress
            )
            save_safetensors(staging / shards.name(index + 1), tensors)
            state.record(asdict(report), hidden)
            advance(1)
    _finalize(ckpt, plan, recipe, staging, shards, record)
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
        resumed_layers=resumed,
        seconds=time.perf_counter() - started,
        size_bytes={"source": _weights_size(ckpt.path), "output": _weights_size(out)},
    )


def _layer_report(raw: dict[str, Any]) -> LayerReport:
    linears = [LinearReport(**linear) for linear in raw["linears"]]
    return LayerReport(**{**raw, "linears": linears})


def _initial_hidden(stream: LayerStream, state: RunState, ids: Tensor | None) -> Tensor | None:
    if ids is None:
        return None
    if state.done:
        hidden = state.hidden()
        return None if hidden is None else hidden.to(stream.device)
    return stream.embed(ids)


def _quantize_layer(
    stream: LayerStream,
    index: int,
    linears: list[LinearPlan],
    recipe: Recipe,
    method: Method,
    hidden: Tensor | None,
    calib_stats: CalibStats | None,
    progress: Progress,
) -> tuple[LayerReport, Tensor | None, dict[str, Tensor]]:
    started = time.perf_counter()
    prefix = stream.layout.layer_prefix(index)
    layer = stream.load_layer(index)
    local = {linear.name[len(prefix) :]: linear for linear in linears}
    passes = 0 if hidden is None else 2 * len(list(stream.batches(hidden)))
    with progress.stage(f"layer {index}", total=passes, transient=True) as step:
        reference, observed, output = None, {}, None
        if hidden is not None:
            reference, observed = run_observed(
                stream, layer, list(local), hidden,
                hessian=method.needs_hessian, on_batch=lambda: step(1),
            )  # fmt: skip
        stats = {name: _stats_for(calib_stats, observed, prefix, name) for name in local}
        fmt = scheme_format(recipe.scheme)
        tensors, linear_reports = _quantize_linears(layer, local, stats, method, fmt)
        if reference is not None:
            act = recipe.scheme.input_activations
            with activation_quantization(layer, dict.fromkeys(local, act) if act else {}):
                output = stream.run_layer(layer, hidden, on_batch=lambda: step(1))
            _check_finite(output, f"the output of layer {index}")
    error = None if reference is None else _relative_rmse(output, reference)
    tensors = {f"{prefix}{key}": value for key, value in tensors.items()}
    tensors.update(_other_layer_tensors(stream.ckpt, prefix, local))
    report = LayerReport(index, error, time.perf_counter() - started, linear_reports)
    return report, output, tensors


def _stats_for(
    calib_stats: CalibStats | None, observed: dict[str, InputStats], prefix: str, name: str
) -> InputStats | None:
    if calib_stats is not None:
        try:
            return calib_stats.inputs[prefix + name]
        except KeyError:
            raise InputError(
                f"--calib-stats has no statistics for {prefix + name}",
                hint="collect them with `llmq calibrate` on this model",
            ) from None
    return observed.get(name)


def _quantize_linears(
    layer: nn.Module,
    local: dict[str, LinearPlan],
    stats: dict[str, InputStats | None],
    method: Method,
    fmt: PackFormat,
) -> tuple[dict[str, Tensor], list[LinearReport]]:
    """Quantize each linear, put its dequantized weight back for the quantized pass, and return
    its on-disk tensors (names relative to the layer)."""
    tensors: dict[str, Tensor] = {}
    reports = []
    for name, linear in local.items():
        module = layer.get_submodule(name)
        weight = module.weight.data
        q = method.quantize_weight(
            weight, linear.args, stats[name], scale_dtype=_TORCH_DTYPES[linear.dtype]
        )
        _check_finite(q.scale, f"the scales of {linear.name}")
        dequantized = q.dequantize(weight.dtype)
        nrmse = float(
            (dequantized - weight).double().norm() / weight.double().norm().clamp_min(1e-30)
        )
        reports.append(LinearReport(linear.name, linear.args.label, nrmse))
        module.weight.data = dequantized
        for suffix, tensor in compress(q, fmt).items():
            tensors[f"{name}.{suffix}"] = tensor.cpu()
    return tensors, reports


def _relative_rmse(output: Tensor, reference: Tensor) -> float:
    diff = (output.double() - reference.double()).norm()
    return float(diff / reference.double().norm().clamp_min(1e-30))


def _check_finite(tensor: Tensor, what: str) -> None:
    if not torch.isfinite(tensor).all():
        raise NumericalError(
            f"NaN or Inf in {what}",
            hint="the source weights or activations may be corrupt; try --ignore for this layer",
        )


def _other_layer_tensors(
    ckpt: Checkpoint, prefix: str, local: dict[str, LinearPlan]
) -> dict[str, Tensor]:
    """Tensors of the layer that are not quantized weights (norms, biases, ignored linears), as stored."""
    quantized = {f"{prefix}{name}.weight" for name in local}
    return {
        name: ckpt.read(name) for name in ckpt.names_with_prefix(prefix) if name not in quantized
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
) -> None:
    from llmq.io.checkpoint import read_safetensors_header

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
    groups = [
        (args, recipe.scheme.input_activations, targets) for args, targets in config_groups(plan)
    ]
    config = dict(ckpt.config)
    config["quantization_config"] = quantization_config(
        groups, ignore=plan.ignored, fmt=scheme_format(recipe.scheme)
    )
    write_json(staging / "config.json", config)
    write_json(staging / RECORD_FILE, record)
    _copy_side_files(ckpt.path, staging)
    (staging / STATE_FILE).unlink(missing_ok=True)
    (staging / HIDDEN_FILE).unlink(missing_ok=True)


def _copy_side_files(source: Path, staging: Path) -> None:
    """Tokenizer, generation config, chat template, license...: everything but weights and config."""
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_FILES) and path.name not in (
            "config.json", "model.safetensors.index.json", RECORD_FILE,
        ):  # fmt: skip
            shutil.copy2(path, staging / path.name)


def _weights_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
