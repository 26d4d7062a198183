"""Plan a quantization run before any work: which linears, with which arguments, in which
config group, and what gets adjusted. Everything that can be wrong with the input fails here."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmq.config import QuantArgs, Recipe, fit_group_size, group_width
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint, TensorInfo, side_files, torch_dtype
from llmq.io.layout import EXPERT
from llmq.io.space import folder_size
from llmq.pack.format import config_target
from llmq.pipeline.state import resume_point_bytes

FLOAT_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True, slots=True)
class GroupSizeAdjustment:
    """A linear whose in_features the requested group size does not divide."""

    name: str
    in_features: int
    requested: int
    used: int | None  # None: fell back to per-channel


@dataclass(slots=True)
class LinearPlan:
    name: str  # full module name, e.g. model.layers.0.self_attn.q_proj
    args: QuantArgs | None  # None: pruned alone, the weight stays in `dtype`
    out_features: int
    in_features: int
    dtype: str  # the stored weight's safetensors dtype; scales are stored in it too
    input_args: QuantArgs | None = None  # None: the input stays in full precision

    @property
    def label(self) -> str:
        """How the weight is stored, e.g. "int4 g128", or "dense"."""
        return "dense" if self.args is None else self.args.label


@dataclass(slots=True)
class Plan:
    layers: list[list[LinearPlan]]  # per decoder layer, the linears to quantize
    ignored: list[str]  # linear module names kept in full precision
    adjustments: list[GroupSizeAdjustment] = field(default_factory=list)

    @property
    def linears(self) -> list[LinearPlan]:
        return [linear for layer in self.layers for linear in layer]


def matches_any(patterns: tuple[str, ...], name: str) -> bool:
    """`re:` patterns match from the start of the name; plain ones match it or its suffix."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith(f".{pattern}"):
            return True
    return False


def plan_quantization(ckpt: Checkpoint, recipe: Recipe) -> Plan:
    """The plan of the layer pipeline: the family layout's linears, layer by layer."""
    refuse_quantized(ckpt.path, ckpt.config)
    layers = [ckpt.layout.linear_names(index) for index in range(ckpt.num_layers)]
    plan = plan_linears(ckpt.path, ckpt.tensors, layers, recipe, lm_head=ckpt.layout.lm_head)
    return _experts_only(ckpt, recipe, plan)


def refuse_quantized(folder: Path, config: dict[str, Any]) -> None:
    quantized = config.get("quantization_config")
    if quantized:
        raise InputError(
            f"{folder}: already quantized "
            f"({quantized.get('format') or quantized.get('quant_method')})",
            hint="quantize the original float checkpoint",
        )


MXFP4_RELEASE_SCHEME = "mxfp4a16"


def _experts_only(ckpt: Checkpoint, recipe: Recipe, plan: Plan) -> Plan:
    """GPT-OSS (experts stored fused): the only quantized checkpoint transformers and vLLM load
    is its own release format, every expert MXFP4 and everything else in 16 bits. So its
    quantization takes that scheme, quantizes every expert and keeps the other linears
    (attention) as they are; pruning alone plans as any family does."""
    experts = ckpt.layout.experts
    if experts is None or not experts.stored_fused or recipe.weight_args is None:
        return plan
    family = f"model_type {ckpt.config.get('model_type')!r}"
    if recipe.scheme.name.lower() != MXFP4_RELEASE_SCHEME:
        raise InputError(
            f"--scheme {recipe.scheme.name.lower()}: {family} stores its experts fused, and its quantized "
            "checkpoints hold them MXFP4 (its own release format), everything else in 16 bits",
            hint=f"use --scheme {MXFP4_RELEASE_SCHEME}",
        )
    if recipe.kv_cache_args is not None:
        raise InputError(f"--kv-cache: {family}'s MXFP4 release format holds only its experts quantized")  # fmt: skip
    in_experts = re.compile(rf"{re.escape(ckpt.layout.layers)}\.\d+\.{re.escape(experts.module)}\.")
    kept = [name for name in plan.ignored if in_experts.match(name)]
    if kept:
        raise InputError(
            f"{kept[0]}: kept in full precision (--ignore or --fallback), but {family}'s MXFP4 "
            "release format quantizes every expert of a layer together",
            hint="drop the --ignore or --fallback that names experts",
        )
    layers = [
        [linear for linear in layer if in_experts.match(linear.name)] for layer in plan.layers
    ]
    others = [linear.name for layer in plan.layers for linear in layer if not in_experts.match(linear.name)]  # fmt: skip
    return Plan(layers=layers, ignored=[*plan.ignored, *others], adjustments=plan.adjustments)


def plan_linears(
    folder: Path,
    tensors: dict[str, TensorInfo],
    layers: list[list[str]],
    recipe: Recipe,
    *,
    lm_head: str,
) -> Plan:
    """Each linear of `layers` (module names, per layer) with its arguments, less those
    `--ignore` keeps (and the LM head, always kept); `tensors`: the checkpoint's, at `folder`."""
    check_patterns(
        "--ignore", recipe.ignore, [lm_head, *(n for layer in layers for n in layer)], "linears"
    )
    planned_layers: list[list[LinearPlan]] = []
    ignored = [lm_head]
    adjustments: list[GroupSizeAdjustment] = []
    for names in layers:
        planned = []
        for name in names:
            if matches_any(recipe.ignore, name):
                ignored.append(name)
                continue
            planned.append(_plan_linear(folder, tensors, name, recipe, adjustments))
        planned_layers.append(planned)
    if recipe.strict_group_size and adjustments:
        _refuse_non_dividing(adjustments)
    return Plan(layers=planned_layers, ignored=ignored, adjustments=adjustments)


def with_schemes(plan: Plan, schemes: dict[str, QuantArgs | None]) -> Plan:
    """`plan` with each named linear's weight arguments replaced (mixed precision's choice); a
    linear given None is kept dense and joins `ignored`."""
    layers = [
        [replace(linear, args=schemes.get(linear.name, linear.args)) for linear in layer]
        for layer in plan.layers
    ]
    dense = [linear.name for layer in layers for linear in layer if linear.args is None]
    kept = [[linear for linear in layer if linear.args is not None] for layer in layers]
    # the scheme's group-size adjustments no longer apply: each choice is fitted to its linear
    return Plan(layers=kept, ignored=[*plan.ignored, *dense])


def check_patterns(option: str, patterns: tuple[str, ...], names: list[str], what: str) -> None:
    """Each pattern of `option` (--ignore, --targets) must compile and match one of `names`
    (`what` they are, for the error): a typo would otherwise quantize the linear it meant to
    keep, or keep the one it meant to quantize, and show only in the output."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                raise InputError(
                    f"{option} {pattern!r}: invalid regular expression ({exc})"
                ) from None
        if not any(matches_any((pattern,), name) for name in names):
            raise InputError(
                f"{option} {pattern!r}: matches none of this model's {len(names)} {what}",
                hint=f"names look like {names[-1]!r}; a plain pattern is a whole name or the "
                "part after a dot, a `re:` one a regular expression matched from the start"
                if names else f"the checkpoint has no {what}",
            )  # fmt: skip


def _plan_linear(
    folder: Path,
    tensors: dict[str, TensorInfo],
    name: str,
    recipe: Recipe,
    adjustments: list[GroupSizeAdjustment],
) -> LinearPlan:
    key = f"{name}.weight"
    info = tensors.get(key)
    if info is None:
        raise InputError(f"{folder}: tensor {key!r} is missing", hint="the checkpoint is incomplete")  # fmt: skip
    if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
        raise InputError(
            f"{folder}: {key} is {info.dtype}{list(info.shape)}; expected a 2-D float weight "
            f"({', '.join(FLOAT_DTYPES)})"
        )
    out_features, in_features = info.shape
    pattern = recipe.nm_pattern
    if pattern is not None and in_features % pattern[1]:
        raise InputError(
            f"--pattern {recipe.pattern}: {pattern[1]} does not divide in_features {in_features} "
            f"of {name}",
            hint=f"an N:M pattern groups M consecutive inputs; use an M that divides {in_features}",
        )
    args = recipe.weight_args
    width = group_width(args) if args is not None else None
    if args is not None and width is not None and in_features % width:
        args = _divisible_args(name, in_features, args, adjustments)
    # per-token-group activations use the weight's block width (the kernels need them equal)
    inputs = recipe.activation_args
    if inputs is not None and inputs.strategy == "group":
        inputs = fit_group_size(inputs, in_features)
    return LinearPlan(name, args, out_features, in_features, info.dtype, inputs)


def _divisible_args(
    name: str, in_features: int, args: QuantArgs, adjustments: list[GroupSizeAdjustment]
) -> QuantArgs:
    fitted = fit_group_size(args, in_features)
    adjustments.append(
        GroupSizeAdjustment(name, in_features, int(group_width(args) or 0), group_width(fitted))
    )
    return fitted


def _refuse_non_dividing(adjustments: list[GroupSizeAdjustment]) -> None:
    first = adjustments[0]
    usable = [g for g in (16, 32, 64, 128, 256, 512, 1024) if first.in_features % g == 0]
    raise InputError(
        f"group_size {first.requested} does not divide in_features {first.in_features} of "
        f"{first.name} ({len(adjustments)} linears affected)",
        hint=f"usable group sizes: {', '.join(map(str, usable)) or 'none'}, or --group-size -1 "
        "for per-channel; without --strict-group-size llmq picks the largest usable one per layer",
    )


ArgsPair = tuple[QuantArgs, QuantArgs | None]  # weights, input activations


def config_groups(plan: Plan) -> list[tuple[QuantArgs, QuantArgs | None, list[str]]]:
    """Config groups with disjoint targets: per (weight, input) argument pair, regexes over
    module-name suffixes where a suffix always has the same arguments, exact names elsewhere."""
    suffix_args: dict[str, set[ArgsPair]] = defaultdict(set)
    for linear in plan.linears:
        suffix_args[_suffix(linear.name)].add((linear.args, linear.input_args))
    targets: dict[ArgsPair, list[str]] = defaultdict(list)
    for linear in plan.linears:
        suffix, key = _suffix(linear.name), (linear.args, linear.input_args)
        if len(suffix_args[suffix]) == 1:
            target = config_target(suffix)
            if target not in targets[key]:
                targets[key].append(target)
        else:
            targets[key].append(linear.name)
    return [(weights, inputs, names) for (weights, inputs), names in targets.items()]


def _suffix(name: str) -> str:
    """`self_attn.q_proj` from `model.layers.12.self_attn.q_proj`; `mlp.experts.*.up_proj` from
    `model.layers.12.mlp.experts.3.up_proj` (every expert of a role in one target)."""
    return re.sub(r"\.\d+\.", f".{EXPERT}.", re.sub(r"^.*?\.\d+\.", "", name))


_ENTRY_BYTES = 256  # a tensor's header entry in its shard and its line in the index, at most


def disk_needed(ckpt: Checkpoint, plan: Plan, recipe: Recipe, resumed: Path | None) -> int:
    """Disk a quantization run needs: the output, its resume points, less what the partial
    output being resumed (`resumed`, its staging folder) already holds."""
    needed = output_bytes(ckpt.path, ckpt.tensors, plan)
    if recipe.calibration is not None:
        cal = recipe.calibration
        needed += resume_point_bytes(cal.num_samples, cal.seq_len, ckpt.config["hidden_size"])
    if resumed is not None:
        needed -= folder_size(resumed)
    return max(needed, 0)


def output_bytes(folder: Path, tensors: dict[str, TensorInfo], plan: Plan) -> int:
    """An upper estimate of the checkpoint a plan writes (for the space check before any work):
    packed codes, scales and zero points for the planned linears, every other tensor as it is
    stored, headers, config and the side files."""
    planned = {f"{linear.name}.weight": linear for linear in plan.linears}
    # config.json with its quantization_config; per stored tensor (up to five for a quantized
    # weight), its safetensors header and index entries
    total = 64 * 1024 + len(tensors) * 5 * _ENTRY_BYTES
    for name, info in tensors.items():
        linear = planned.get(name)
        if linear is not None and linear.args is not None:
            total += _quantized_bytes(linear.args, linear.out_features, linear.in_features)
        else:
            total += math.prod(info.shape) * torch_dtype(info.dtype).itemsize
    return total + sum(path.stat().st_size for path in side_files(folder))


def _quantized_bytes(args: QuantArgs, rows: int, columns: int) -> int:
    """Codes packed into 32-bit words (or one byte each), scales in float32 (an upper bound
    on the weight's own dtype), zero points as wide as the scales."""
    codes = rows * math.ceil(columns * args.num_bits / 32) * 4
    if args.strategy == "group":
        scales = rows * math.ceil(columns / int(args.group_size or columns))
    elif args.strategy == "block" and args.block_structure is not None:
        block_rows, block_columns = args.block_structure
        scales = math.ceil(rows / block_rows) * math.ceil(columns / block_columns)
    elif args.strategy == "channel":
        scales = rows
    else:
        scales = 1
    return codes + scales * 4 * (1 if args.symmetric else 2)
