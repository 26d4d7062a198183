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
from dataclasses import dataclass, replace
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
                importance.heads[i], groups, heads // kv_heads, keep_heads // keep_groups
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


BUDGET_CHANNELS = 64
"""`--params` and `--decoder-params` narrow the MLP to a multiple of this many channels."""


@dataclass(frozen=True, slots=True)
class ParameterCount:
    total: int  # every parameter once (a tied lm_head is the embedding)
    decoder: int  # the decoder layers' alone

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "decoder": self.decoder}


def count_parameters(config: dict[str, Any], layers: str) -> ParameterCount:
    """The parameters of the model transformers builds from `config`, exactly as it loads them
    (biases, q/k norms, a tied lm_head once), built on the meta device: nothing is allocated.
    `layers`: the decoder layers' prefix (DecoderLayout.layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**plain))
    total = decoder = 0
    for name, param in model.named_parameters():
        total += param.numel()
        decoder += param.numel() if name.startswith(f"{layers}.") else 0
    return ParameterCount(total, decoder)


def budget_targets(
    config: dict[str, Any],
    layers: str,
    share: float,
    *,
    decoder: bool = False,
    given: Targets = Targets(),
) -> Targets:
    """`--params F`: the widest MLP, a multiple of BUDGET_CHANNELS, whose model keeps at most F
    of all the source's parameters (the embedding and a tied lm_head once), so within one such
    step of F; `decoder` (`--decoder-params F`): of the decoder layers' alone. The other sizes
    are `given` (Minitron's guidance: width before depth, the MLP first; the hidden size, which
    narrows the embedding too, only when asked). `layers`: as in `count_parameters`."""
    option = "--decoder-params" if decoder else "--params"
    if not 0 < share < 1:
        raise InputError(f"{option} {share}: a share of the parameters in (0, 1)")
    if given.intermediate_size is not None:
        raise InputError(f"{option} chooses the MLP width: give it or --intermediate-size, not both")  # fmt: skip

    def counted(channels: int) -> ParameterCount:
        return count_parameters(pruned_config(config, replace(given, intermediate_size=channels)), layers)  # fmt: skip

    def part(count: ParameterCount) -> int:
        return count.decoder if decoder else count.total

    source = count_parameters(config, layers)
    whole, inter, step = part(source), config["intermediate_size"], BUDGET_CHANNELS
    of_what = f"of the {'decoder layers' if decoder else 'model'}'s {whole / 1e6:.1f}M parameters"
    widest = counted(inter)
    per_channel = part(widest) - part(counted(inter - 1)) if inter > 1 else part(widest)
    exact = inter - (part(widest) - share * whole) / per_channel  # the count is affine in the width
    if exact >= inter + step:
        raise InputError(
            f"{option} {share}: the other targets alone keep {part(widest) / whole:.1%} {of_what}",
            hint="ask for less, or keep more layers, groups or hidden channels",
        )
    channels = min(math.floor(exact / step + 1e-9) * step, inter)
    narrowest = min(step, inter)
    if channels < narrowest:
        least = counted(narrowest)
        rest = part(least) - per_channel * narrowest  # what narrowing the MLP cannot remove
        outside = 0 if decoder else least.total - least.decoder
        why = f"embeddings {outside / whole:.1%}, " if outside else ""
        raise InputError(
            f"{option} {share}: narrowing the MLP keeps at least {part(least) / whole:.1%} "
            f"{of_what} ({why}attention and norms {(rest - outside) / whole:.1%})",
            hint=f"give --hidden-size or --num-layers too: {option} sizes the MLP around them",
        )
    return replace(given, intermediate_size=channels)


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
