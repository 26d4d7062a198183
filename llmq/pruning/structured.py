"""Structured pruning (`llmq prune --structured`): remove whole MLP channels, key-value groups
(with their query heads), hidden (embedding) channels and decoder layers, the least important
first, with the same width in every layer so that the result is a plain, smaller checkpoint
every loader reads.

Importance comes from one calibration pass over the dense model (`score_model`): per layer,
each MLP channel's and each key-value group's L2 norm over the calibration tokens, and the
layer's Block Importance; per model, each hidden channel's L2 norm over every RMSNorm output
(llmq.pruning.importance). Each layer keeps its own most important channels and groups; the
hidden channels kept are the same everywhere (the residual stream runs through every layer);
the layers kept are those of highest Block Importance, in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmq.calib.collect import collect_stats
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress
from llmq.pruning.importance import (
    block_importance,
    channel_importance,
    head_importance,
    hidden_importance,
    kept_indices,
    kv_group_importance,
)

# What reads and what writes the residual stream in a Llama-style layer (the only layout
# `--structured` takes): hidden channels are columns of the readers, rows of the writers.
HIDDEN_READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")  # fmt: skip
HIDDEN_WRITERS = ("self_attn.o_proj", "mlp.down_proj")
HIDDEN_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True, slots=True)
class Targets:
    """The sizes wanted (None: keep the model's)."""

    intermediate_size: int | None = None
    num_kv_heads: int | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None  # query heads, the same number in every key-value group kept


@dataclass(slots=True)
class Importance:
    """What the scoring pass measured, per decoder layer (saved so that several targets reuse
    one pass)."""

    channels: list[Tensor]  # [intermediate] per layer
    kv_groups: list[Tensor]  # [num_kv_heads] per layer
    heads: list[Tensor]  # [num_attention_heads] per layer
    blocks: Tensor  # [layers] Block Importance
    hidden: Tensor  # [hidden_size], over the whole model

    def save(self, path: Path) -> None:
        from llmq.io.atomic import save_safetensors

        tensors = {"blocks": self.blocks.contiguous(), "hidden": self.hidden.contiguous()}
        for index, (channels, groups, heads) in enumerate(
            zip(self.channels, self.kv_groups, self.heads, strict=True)
        ):
            tensors[f"layers.{index}.channels"] = channels.contiguous()
            tensors[f"layers.{index}.kv_groups"] = groups.contiguous()
            tensors[f"layers.{index}.heads"] = heads.contiguous()
        save_safetensors(path, tensors, {"format": IMPORTANCE_FORMAT})

    @classmethod
    def load(cls, path: Path) -> Importance:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(path)
            layers = len(tensors["blocks"])
            return cls(
                [tensors[f"layers.{i}.channels"] for i in range(layers)],
                [tensors[f"layers.{i}.kv_groups"] for i in range(layers)],
                [tensors[f"layers.{i}.heads"] for i in range(layers)],
                tensors["blocks"],
                tensors["hidden"],
            )
        except (OSError, KeyError, SafetensorError) as exc:
            raise InputError(f"{path}: not an importance file ({exc})") from None


IMPORTANCE_FORMAT = "llmq-importance/2"  # 2: with hidden channels


def score_model(
    ckpt: Checkpoint,
    input_ids: Tensor,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Importance:
    """One pass over the dense model on the calibration windows."""
    config = ckpt.config
    heads, kv_heads = config["num_attention_heads"], _kv_heads(config)
    blocks: list[float] = []
    stats = collect_stats(
        ckpt, input_ids, norms=True, progress=progress, device=device,
        on_layer=lambda _index, before, after: blocks.append(block_importance(before, after)),
    )  # fmt: skip
    channels, groups, head_scores, norm_outputs = [], [], [], []
    for index in range(ckpt.num_layers):
        prefix = ckpt.layout.layer_prefix(index)
        down, o_proj = (
            stats.inputs[prefix + "mlp.down_proj"],
            stats.inputs[prefix + "self_attn.o_proj"],
        )
        assert down.sq_sum is not None and o_proj.sq_sum is not None
        channels.append(channel_importance(down.sq_sum))
        head_scores.append(head_importance(o_proj.sq_sum, heads))
        groups.append(kv_group_importance(head_scores[-1], kv_heads))
        for reader in ("self_attn.q_proj", "mlp.gate_proj"):  # the outputs of the two norms
            sq_sum = stats.inputs[prefix + reader].sq_sum
            assert sq_sum is not None
            norm_outputs.append(sq_sum)
    blocks_t = torch.tensor(blocks, dtype=torch.float64)
    return Importance(channels, groups, head_scores, blocks_t, hidden_importance(norm_outputs))


DEPTH_METRIC_WINDOWS = 16
"""Calibration windows the `ppl` depth metric runs on: it holds one copy of their hidden states
per layer (the default model: 31 x 19 MB), so it reads the first 16, not all of them."""


def depth_by_perplexity(
    ckpt: Checkpoint,
    input_ids: Tensor,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Tensor:
    """[layers] the relative perplexity increase from dropping each layer alone (the layer's
    output replaced by its input), on the first DEPTH_METRIC_WINDOWS windows.

    One pass over the layers, each loaded once: branch i (the model without layer i) forks
    from the full model's hidden states just before layer i and skips it; every other layer
    runs on every branch that exists by then, about layers² / 2 layer passes in all."""
    from llmq.calib.stream import LayerStream

    ids = input_ids[:DEPTH_METRIC_WINDOWS]
    stream = LayerStream(ckpt, device=device)
    full = stream.embed(ids)
    dropped: list[Tensor] = []
    with torch.inference_mode(), progress.stage("dropping each layer in turn", total=ckpt.num_layers) as advance:  # fmt: skip
        for index in range(ckpt.num_layers):
            layer = stream.load_layer(index)
            branches = [*dropped, full]
            dropped.append(full.clone())
            for hidden in branches:
                stream.run_layer(layer, hidden, in_place=True)
            advance(1)
    base, count = stream.token_nll(full, ids)
    scores = [math.exp((stream.token_nll(hidden, ids)[0] - base) / count) - 1.0 for hidden in dropped]  # fmt: skip
    return torch.tensor(scores, dtype=torch.float64)


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
            "num_key_value_heads": [_kv_heads(source), self.config["num_key_value_heads"]],
            "num_attention_heads": [
                source["num_attention_heads"],
                self.config["num_attention_heads"],
            ],
            "hidden_size": [source["hidden_size"], self.config["hidden_size"]],
        }


def plan_structured(
    config: dict[str, Any], importance: Importance, targets: Targets
) -> StructuredPlan:
    """Which layers, channels and groups stay (InputError for targets the model cannot take)."""
    layers_n, inter, heads = (
        config["num_hidden_layers"],
        config["intermediate_size"],
        config["num_attention_heads"],
    )
    kv_heads = _kv_heads(config)
    keep_layers, keep_inter, keep_groups, keep_hidden, keep_heads = kept_sizes(config, targets)
    if (len(importance.blocks), len(importance.channels[0]), len(importance.hidden)) != (
        layers_n,
        inter,
        config["hidden_size"],
    ):
        raise InputError("--importance: scored on a model of another shape")
    layers = kept_indices(importance.blocks, keep_layers).tolist()
    new = dict(config)
    new.update(
        num_hidden_layers=keep_layers, intermediate_size=keep_inter,
        num_key_value_heads=keep_groups, num_attention_heads=keep_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads, hidden_size=keep_hidden,
    )  # fmt: skip
    if isinstance(config.get("layer_types"), list):
        new["layer_types"] = [config["layer_types"][i] for i in layers]
    kv_groups = [kept_indices(importance.kv_groups[i], keep_groups) for i in layers]
    return StructuredPlan(
        layers=layers,
        channels=[kept_indices(importance.channels[i], keep_inter) for i in layers],
        kv_groups=kv_groups,
        query_heads=[
            _kept_query_heads(
                importance.heads[i], groups, heads // kv_heads, keep_heads // keep_groups
            )
            for i, groups in zip(layers, kv_groups, strict=True)
        ],
        hidden=_kept_hidden(importance.hidden, keep_hidden),
        config=new,
    )


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
        _checked("--num-kv-heads", targets.num_kv_heads, _kv_heads(config)),
        _checked("--hidden-size", targets.hidden_size, config["hidden_size"]),
    )
    heads = config["num_attention_heads"] // _kv_heads(config) * sizes[2]
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


def budget_targets(config: dict[str, Any], params: float) -> Targets:
    """`--params F`: keep about F of the decoder layers' parameters by narrowing the MLP alone
    (Minitron's guidance: width before depth, MLP first), to a multiple of 64 channels."""
    if not 0 < params < 1:
        raise InputError(f"--params {params}: a share of the parameters in (0, 1)")
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    attention = hidden * head_dim * (2 * config["num_attention_heads"] + 2 * _kv_heads(config))
    mlp = 3 * hidden * inter
    wanted = params * (attention + mlp) - attention
    channels = int(wanted / (3 * hidden)) // 64 * 64
    if channels < 64:
        raise InputError(
            f"--params {params}: narrowing the MLP alone cannot reach it (attention is "
            f"{attention / (attention + mlp):.0%} of each layer)",
            hint="give explicit targets: --num-layers, --num-kv-heads, --intermediate-size",
        )
    return Targets(intermediate_size=min(channels, inter))


def slice_layer(
    tensors: dict[str, Tensor],
    channels: Tensor,
    kv_groups: Tensor,
    query_heads: Tensor,
    config: dict[str, Any],
    hidden: Tensor | None = None,
) -> dict[str, Tensor]:
    """A layer's tensors (names relative to the layer) with only the kept MLP channels,
    key-value groups (each with its query heads) and hidden channels; anything else as it was."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rows = {
        "self_attn.q_proj": _head_rows(query_heads, head_dim),
        "self_attn.k_proj": _head_rows(kv_groups, head_dim),
        "self_attn.v_proj": _head_rows(kv_groups, head_dim),
        "mlp.gate_proj": channels,
        "mlp.up_proj": channels,
    }
    columns = {"self_attn.o_proj": _head_rows(query_heads, head_dim), "mlp.down_proj": channels}
    sliced = {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        if module in rows:  # weight [out, in] or bias [out]
            tensor = tensor.index_select(0, rows[module])
        elif module in columns and kind == "weight":
            tensor = tensor.index_select(1, columns[module])
        sliced[name] = tensor
    if hidden is not None:
        sliced = _hidden_sliced(sliced, hidden)
    return {name: tensor.contiguous() for name, tensor in sliced.items()}


def _hidden_sliced(tensors: dict[str, Tensor], hidden: Tensor) -> dict[str, Tensor]:
    """Only the kept hidden channels: columns of what reads the residual stream, rows (and
    biases) of what writes it, entries of the norms in front of the readers."""
    sliced = {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        if module in HIDDEN_READERS and kind == "weight":
            tensor = tensor.index_select(1, hidden)
        elif module in HIDDEN_WRITERS or module in HIDDEN_NORMS:
            tensor = tensor.index_select(0, hidden)
        sliced[name] = tensor
    return sliced


def slice_outer(
    tensors: dict[str, Tensor], hidden: Tensor | None, layout: Any
) -> dict[str, Tensor]:
    """The tensors outside the decoder layers with only the kept hidden channels: the
    embedding's and lm_head's columns, the final norm's entries."""
    if hidden is None:
        return tensors
    by_hidden = {f"{layout.embed}.weight": 1, f"{layout.lm_head}.weight": 1, f"{layout.final_norm}.weight": 0}  # fmt: skip
    sliced = dict(tensors)
    for name, dim in by_hidden.items():
        if name in sliced:  # lm_head is absent when tied to the embedding
            sliced[name] = sliced[name].index_select(dim, hidden).contiguous()
    return sliced


def parameter_count(config: dict[str, Any]) -> int:
    """About the parameters of a Llama-style decoder of this config (embeddings and lm_head
    included, biases not): what the space check reserves."""
    hidden, inter, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
    )
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * _kv_heads(config))
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def _head_rows(heads: Tensor, head_dim: int) -> Tensor:
    return (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()


def _kv_heads(config: dict[str, Any]) -> int:
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])


def _checked(option: str, target: int | None, size: int) -> int:
    if target is None:
        return size
    if not 0 < target <= size:
        raise InputError(f"{option} {target}: the model has {size}; keep between 1 and {size}")
    return target
