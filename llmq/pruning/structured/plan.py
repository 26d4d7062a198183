"""What structured pruning keeps: the sizes asked for, checked against the model, and the
layers, channels, groups and heads of highest importance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.io.family import FAMILY_LAYOUT
from llmq.io.layout import StructuredRoles
from llmq.pruning.importance import kept_indices

if TYPE_CHECKING:
    from llmq.pruning.structured.score import Importance


@dataclass(frozen=True, slots=True)
class Targets:
    """The sizes wanted (None: keep the model's)."""

    intermediate_size: int | None = None
    num_kv_heads: int | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None  # query heads, the same number in every key-value group kept


@dataclass(slots=True)
class StructuredPlan:
    layers: list[int]  # the source layers kept, in order
    channels: list[Tensor]  # per kept layer: the MLP channels kept
    kv_groups: list[Tensor]  # per kept layer: the key-value groups kept
    query_heads: list[Tensor]  # per kept layer: the query heads kept, group by group
    hidden: Tensor | None  # the hidden channels kept (None: all of them)
    config: dict[str, Any]  # config.json of the result

    def removed(self, source: dict[str, Any]) -> dict[str, Any]:
        """What went, per axis (llmq.json and the report)."""
        return {
            "layers": sorted(set(range(source["num_hidden_layers"])) - set(self.layers)),
            "intermediate_size": [source["intermediate_size"], self.config["intermediate_size"]],
            "num_key_value_heads": [kv_heads(source), self.config["num_key_value_heads"]],
            "num_attention_heads": [
                source["num_attention_heads"],
                self.config["num_attention_heads"],
            ],
            "hidden_size": [source["hidden_size"], self.config["hidden_size"]],
        }


def structured_roles(ckpt: Checkpoint) -> StructuredRoles:
    """What the family's layers slice along which axis (llmq.io.family); InputError for a
    quantized checkpoint or a family without structured roles."""
    if ckpt.quantization_config:
        raise InputError(f"{ckpt.path}: quantized", hint="prune the original float checkpoint")
    if ckpt.layout.structured is None:
        able = sorted(name for name, layout in FAMILY_LAYOUT.items() if layout.structured)
        raise InputError(
            f"{ckpt.path}: structured pruning cannot slice model_type "
            f"{ckpt.config.get('model_type')!r} (fused, expert or extra-norm layers)",
            hint=f"families it slices: {', '.join(able)}",
        )
    return ckpt.layout.structured


def plan_structured(
    config: dict[str, Any], importance: Importance, targets: Targets
) -> StructuredPlan:
    """Which layers, channels and groups stay (InputError for targets the model cannot take)."""
    layers_n, inter, heads = (
        config["num_hidden_layers"],
        config["intermediate_size"],
        config["num_attention_heads"],
    )
    groups_n = kv_heads(config)
    new = pruned_config(config, targets)
    keep_inter, keep_groups, keep_heads = (
        new["intermediate_size"],
        new["num_key_value_heads"],
        new["num_attention_heads"],
    )
    if (len(importance.blocks), len(importance.channels[0]), len(importance.hidden)) != (
        layers_n,
        inter,
        config["hidden_size"],
    ):
        raise InputError("--importance: scored on a model of another shape")
    layers = kept_indices(importance.blocks, new["num_hidden_layers"]).tolist()
    if isinstance(config.get("layer_types"), list):
        new["layer_types"] = [config["layer_types"][i] for i in layers]
    kv_groups = [kept_indices(importance.kv_groups[i], keep_groups) for i in layers]
    return StructuredPlan(
        layers=layers,
        channels=[kept_indices(importance.channels[i], keep_inter) for i in layers],
        kv_groups=kv_groups,
        query_heads=[
            _kept_query_heads(
                importance.heads[i], groups, heads // groups_n, keep_heads // keep_groups
            )
            for i, groups in zip(layers, kv_groups, strict=True)
        ],
        hidden=_kept_hidden(importance.hidden, new["hidden_size"]),
        config=new,
    )


def pruned_config(config: dict[str, Any], targets: Targets) -> dict[str, Any]:
    """config.json of the result (InputError for a target the model cannot take). Its
    `layer_types` are the first layers' until `plan_structured` knows which layers stay."""
    keep_layers, keep_inter, keep_groups, keep_hidden, keep_heads = kept_sizes(config, targets)
    new = dict(config)
    new.update(
        num_hidden_layers=keep_layers, intermediate_size=keep_inter,
        num_key_value_heads=keep_groups, num_attention_heads=keep_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        hidden_size=keep_hidden,
    )  # fmt: skip
    if isinstance(config.get("layer_types"), list):
        new["layer_types"] = config["layer_types"][:keep_layers]
    return new


def _kept_query_heads(scores: Tensor, groups: Tensor, per_group: int, keep: int) -> Tensor:
    """The `keep` most important query heads of each kept group, group by group (grouped-query
    attention maps new head j to new group j // keep)."""
    return torch.cat(
        [
            g * per_group + kept_indices(scores[g * per_group : (g + 1) * per_group], keep)
            for g in groups.tolist()
        ]
    )


def _kept_hidden(scores: Tensor, keep: int) -> Tensor | None:
    return None if keep == scores.numel() else kept_indices(scores, keep)


def kept_sizes(config: dict[str, Any], targets: Targets) -> tuple[int, int, int, int, int]:
    """Layers, MLP channels, key-value groups, hidden channels and query heads kept (InputError
    for a target the model cannot take): checked before the scoring pass."""
    sizes = (
        _checked("--num-layers", targets.num_layers, config["num_hidden_layers"]),
        _checked("--intermediate-size", targets.intermediate_size, config["intermediate_size"]),
        _checked("--num-kv-heads", targets.num_kv_heads, kv_heads(config)),
        _checked("--hidden-size", targets.hidden_size, config["hidden_size"]),
    )
    heads = config["num_attention_heads"] // kv_heads(config) * sizes[2]
    if targets.num_heads is not None:
        heads = _checked("--num-heads", targets.num_heads, heads)
        if heads % sizes[2]:
            raise InputError(
                f"--num-heads {heads}: does not divide into the {sizes[2]} key-value groups kept",
                hint=f"every group keeps as many query heads: use a multiple of {sizes[2]}",
            )
    if sizes[3] % heads:  # transformers refuses such a config, whatever head_dim says
        below = sizes[3] // heads * heads
        raise InputError(
            f"--hidden-size {sizes[3]}: not a multiple of the {heads} attention heads kept",
            hint=f"use a multiple of {heads}, e.g. {below or heads} or {below + heads}",
        )
    return (*sizes, heads)


def kv_heads(config: dict[str, Any]) -> int:
    """Key-value heads (groups) of a config.json: its query heads' without grouped-query attention."""
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])


def _checked(option: str, target: int | None, size: int) -> int:
    if target is None:
        return size
    if not 0 < target <= size:
        raise InputError(f"{option} {target}: the model has {size}; keep between 1 and {size}")
    return target
