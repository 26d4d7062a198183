"""Model-free conversion's plan: whether a recipe can run without the model (and whether it
should), which tensors are quantized, and the output shards.

Which tensors are quantized: the family layout's decoder linears when llmq knows the family
(the model path's own plan), else every 2-D floating-point weight that `is_linear_weight`
accepts; `--targets` patterns choose instead. The LM head and `--ignore` stay as they are.
NVFP4 quantizes each set of linears vLLM fuses (q/k/v, gate/up) as one stack, as the layer
pipeline does, for the set's one global scale: a set's members go to one output shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmq.config import Recipe
from llmq.errors import InputError, UnsupportedModelError
from llmq.io.checkpoint import TensorInfo, read_config, stored_tensors, torch_dtype
from llmq.io.family import is_linear_weight, layout_for_config, stores_fused_experts
from llmq.io.fp8_release import fp8_block_size
from llmq.io.layout import DecoderLayout
from llmq.pipeline.job import JobInputs
from llmq.pipeline.linears import fused_sets
from llmq.pipeline.plan import (
    FLOAT_DTYPES,
    LinearPlan,
    Plan,
    check_patterns,
    matches_any,
    plan_linears,
    refuse_quantized,
)

# An output shard's size at most (the last tensor may pass it; a larger tensor is a shard of its
# own): what one thread holds before the shard is written.
SHARD_BYTES = 1 << 30


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
    if recipe.weight_args.strategy == "tensor_group" and _layout(config) is None:
        return (
            "NVFP4 gives the linears vLLM fuses (q/k/v, gate/up) one global scale, and llmq "
            f"does not know which of model_type {config.get('model_type')!r}'s linears are fused"
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
    # NVFP4: each planned weight of a fused set -> the set's planned weights, quantized as one
    fused: dict[str, list[str]]


def plan_model_free(folder: Path, recipe: Recipe) -> ModelFreePlan:
    """The linears to quantize and the output shards, from config.json and the headers."""
    config = read_config(folder)
    refuse_quantized(folder, config)
    tensors = stored_tensors(folder)
    layout = _layout(config)  # NVFP4's fused sets, whatever chose the linears
    family = None if recipe.targets else layout
    if family is not None:
        layers = [family.linear_names(i) for i in range(int(config["num_hidden_layers"]))]
        rule = f"the {config.get('model_type')} layout's decoder linears"
    else:
        layers = [_chosen_linears(tensors, recipe.targets)]
        rule = ("--targets " + " ".join(recipe.targets)) if recipe.targets else "every 2-D linear weight"  # fmt: skip
    lm_head = family.lm_head if family is not None else "lm_head"
    plan = plan_linears(folder, tensors, layers, recipe, lm_head=lm_head)
    planned = {f"{linear.name}.weight": linear for linear in plan.linears}
    fused = _fused_weights(layout, int(config.get("num_hidden_layers") or 0), planned)
    shards = _output_shards(tensors, planned, fused)
    return ModelFreePlan(plan, tensors, shards, rule, family is not None, fused)


def _layout(config: dict[str, Any]) -> DecoderLayout | None:
    """The family's layout; None for a family llmq cannot lay out."""
    try:
        return layout_for_config(config)
    except (UnsupportedModelError, InputError):
        return None


def _fused_weights(
    layout: DecoderLayout | None, layers: int, planned: dict[str, LinearPlan]
) -> dict[str, list[str]]:
    """NVFP4's sets (`fused_sets`, as the layer pipeline stacks them): each planned
    tensor_group weight -> its set's planned weights, in the layout's order."""
    if layout is None:
        return {}
    fused: dict[str, list[str]] = {}
    for index in range(layers):
        prefix = layout.layer_prefix(index)
        sets: dict[int, list[str]] = {}
        for local, number in fused_sets(layout.at(index)).items():
            name = f"{prefix}{local}.weight"
            linear = planned.get(name)
            if linear is not None and linear.args is not None and linear.args.strategy == "tensor_group":  # fmt: skip
                sets.setdefault(number, []).append(name)
        fused.update({name: members for members in sets.values() for name in members})
    return fused


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
    tensors: dict[str, TensorInfo], planned: dict[str, LinearPlan], fused: dict[str, list[str]]
) -> list[list[str]]:
    """The stored tensors cut into output shards of about SHARD_BYTES, in the source's order
    (shard by shard, then by name), so that a thread reads mostly one source file; a fused set
    (NVFP4) where its first member falls, whole."""
    shards: list[list[str]] = [[]]
    size = 0
    placed: set[str] = set()
    for first in sorted(tensors, key=lambda n: (tensors[n].shard.name, n)):
        if first in placed:
            continue
        members = fused.get(first, [first])
        nbytes = sum(_stored_bytes(tensors[n]) if n not in planned else _packed_bytes(planned[n]) for n in members)  # fmt: skip
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].extend(members)
        placed.update(members)
        size += nbytes
    return shards


def _stored_bytes(info: TensorInfo) -> int:
    return torch_dtype(info.dtype).itemsize * math.prod(info.shape)


def _packed_bytes(linear: LinearPlan) -> int:
    assert linear.args is not None
    return max(1, linear.out_features * linear.in_features * linear.args.num_bits // 8)
