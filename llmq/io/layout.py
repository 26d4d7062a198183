"""The types of the family table (llmq.io.family): a decoder family's module names as data.

`DecoderLayout` names one family's modules and says which linears share an input, which norm
or linear feeds them (where AWQ and SmoothQuant fold scales), what structured pruning slices
(`StructuredRoles`) and how a mixture of experts stores its experts (`Experts`). `for_config`
writes a layout out for one model's config (its expert count, its dense layers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from llmq.errors import UnsupportedModelError

EXPERT = "*"  # where an expert's index goes in a mixture-of-experts layout's module names


@dataclass(frozen=True, slots=True)
class StructuredRoles:
    """What structured pruning slices in one layer (names relative to it), by what it removes:
    query heads are rows of `query` and columns of `attention_output`; key-value groups rows of
    `key_value`; MLP channels rows of `mlp_input` and columns of `mlp_output`. Hidden channels
    are columns of the linears reading the residual stream (`hidden_readers`), rows of those
    writing it (`hidden_writers`) and entries of the `norms` in front of the readers."""

    query: str
    key_value: tuple[str, ...]
    attention_output: str
    mlp_input: tuple[str, ...]  # gate and up: the MLP channels are their output rows
    mlp_output: str
    norms: tuple[str, ...]  # the norms feeding the attention and the MLP, in that order

    @property
    def hidden_readers(self) -> tuple[str, ...]:
        return (self.query, *self.key_value, *self.mlp_input)

    @property
    def hidden_writers(self) -> tuple[str, ...]:
        return (self.attention_output, self.mlp_output)

    @property
    def norm_readers(self) -> tuple[str, ...]:
        """One linear reading each norm's output, in the order of `norms`."""
        return (self.query, self.mlp_input[0])


@dataclass(frozen=True, slots=True)
class Experts:
    """A mixture-of-experts MLP as checkpoints store it: gated experts (as many as the config
    says, under the first of `count_keys` it has) under
    `module` (`{module}.{e}.{gate}` ...), routed by `router`. transformers fuses them into 3-D
    parameters in memory; llmq holds each as plain linears under these names (calib/experts.py),
    so every method sees the linears the checkpoint has and writes them back under its names."""

    module: str  # e.g. "mlp.experts"
    router: str  # e.g. "mlp.gate": not a linear llmq quantizes, kept in 16 bits
    gate: str
    up: str
    down: str
    # Qwen2-MoE's shared expert (a plain gated MLP every token takes, quantized like the
    # experts) and the gate that weighs it (kept in 16 bits, like the router)
    shared: str | None = None
    shared_gate: str | None = None
    # The attribute transformers 5 gives the mixture-of-experts block where the checkpoint
    # names it otherwise (Mixtral's `block_sparse_moe` is its `mlp`); llmq registers the block
    # under the checkpoint's name (calib/experts.py).
    loaded_as: str | None = None
    # transformers 5 writes `num_local_experts` where hub Qwen3-MoE configs say `num_experts`
    count_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    # GPT-OSS stores a layer's experts fused, as transformers holds them: `{module}.{fused_gate_up}`
    # [E, in, 2 x out] (gate and up interleaved in its columns), `{module}.{fused_down}`
    # [E, in, out], each with a `_bias`; its hub releases hold them MXFP4 (`_blocks`, `_scales`).
    # llmq reads them as the per-expert linears above and writes them back fused
    # (llmq.io.fused_experts); None: every expert's linears stored under their own names.
    fused_gate_up: str | None = None
    fused_down: str | None = None

    def count(self, config: dict[str, Any]) -> int:
        for key in self.count_keys:
            if config.get(key):
                return int(config[key])
        raise UnsupportedModelError(
            f"config.json names no expert count ({', '.join(self.count_keys)})"
        )

    @property
    def stored_fused(self) -> bool:
        return self.fused_gate_up is not None

    def linear(self, role: str) -> str:
        """The layout's name of one role's linear (gate, up or down), EXPERT for the index."""
        return f"{self.module}.{EXPERT}.{getattr(self, role)}"


@dataclass(frozen=True, slots=True)
class DecoderLayout:
    """Module names of one decoder-only family, relative to the checkpoint root or to one layer."""

    embed: str
    layers: str  # prefix of the decoder layers: f"{layers}.{i}."
    final_norm: str
    lm_head: str
    rotary: str  # the model-level rotary embedding module (cos/sin shared by all layers)
    attention: str  # a layer's attention module: KV cache scales (k_scale, v_scale) live on it
    mlp: str  # a layer's MLP module
    # Linears of one layer, grouped by shared input, in execution order. Members of a group read
    # the same activations, so they share calibration statistics (and a GPTQ Hessian).
    sequential: tuple[tuple[str, ...], ...]
    # (producer, linears reading its output), in execution order: where AWQ and SmoothQuant fold
    # per-channel scales. A producer is a norm (its weight absorbs 1/s) or a linear (its output
    # rows do; used only where its out_features equal the consumers' in_features, so not for
    # v_proj -> o_proj under grouped-query attention).
    smooth: tuple[tuple[str, tuple[str, ...]], ...]
    # Producers that a fixed SmoothQuant alpha folds into: the norms and v_proj, as in the paper
    # and llm-compressor. up_proj -> down_proj is left to `--smooth auto`, which measures whether
    # scaling helps: the down_proj input (SiLU(gate) · up) is not normalized, and alpha 0.8 there
    # made the default model's W8A8 out-of-domain perplexity increase 1.6x (benchmarks/RESULTS.md).
    fixed_alpha_producers: tuple[str, ...]
    # Which linears structured pruning slices along which axis; None: `prune --structured`
    # refuses the family.
    structured: StructuredRoles | None = None
    # A mixture of experts in every layer's MLP: names above hold EXPERT for the expert's index,
    # and `for_config` writes them out for a model's expert count.
    experts: Experts | None = None
    # Gemma's RMSNorms multiply by (1 + weight), not weight: a scale folded into a norm
    # divides (offset + weight), and the stored weight is that minus the offset again.
    norm_weight_offset: float = 0.0
    # Linears that hold several projections in their output rows (Phi-3's qkv_proj: q, k, v;
    # gate_up_proj: gate, up), with how many equal parts they hold when a pairing applies. A
    # fused producer's consumer reads its last part (v, up): a scale folds into those rows, and
    # only when the parts are equal and as wide as the consumer's input (not under GQA).
    fused_parts: tuple[tuple[str, int], ...] = ()
    # A mixture of experts with plain gated MLPs in some layers (DeepSeek-V3's first
    # `first_k_dense_replace`, Qwen-MoE's `mlp_only_layers`): those layers' layout, and which
    # layers they are (written by `for_config`; `at` picks).
    dense: DecoderLayout | None = None
    dense_layers: frozenset[int] = frozenset()
    # Multi-head latent attention (DeepSeek): the KV cache holds a compressed latent, not the
    # keys and values that KV cache scales are for.
    latent_attention: bool = False
    # config.json keys the layout needs set (DeepSeek without q_lora_rank has a plain q_proj)
    required_config: tuple[str, ...] = ()
    # Found from the module tree (llmq.io.discover), not from the family table: printed in the
    # report, and quantized without group-by-group staging.
    discovered: bool = False

    def at(self, index: int) -> DecoderLayout:
        """The layout of decoder layer `index`: the model's, or its dense layers'."""
        if self.dense is not None and index in self.dense_layers:
            return self.dense
        return self

    def expert_groups_split(self) -> DecoderLayout:
        """The groups when each expert sees only the tokens routed to it (`--moe-calibration
        routed`): an expert's gate and up share an input, no two experts do."""
        if self.experts is None:
            return self
        split: list[tuple[str, ...]] = []
        for group in self.sequential:
            owners = dict.fromkeys(self.expert_of(name) for name in group)
            split.extend(tuple(n for n in group if self.expert_of(n) == o) for o in owners)
        return replace(self, sequential=tuple(split))

    def expert_of(self, name: str) -> str | None:
        """The expert a layer-local module name belongs to (`mlp.experts.3.up_proj` -> "3"), None
        for a module of no expert."""
        if self.experts is None or not name.startswith(f"{self.experts.module}."):
            return None
        return name[len(self.experts.module) + 1 :].split(".")[0]

    def float_readers(self, producer: str) -> tuple[str, ...]:
        """Modules that read `producer`'s output and stay in float (a mixture of experts' router
        reads the MLP's norm): a scale folded into the producer is undone in their columns too,
        or the router would pick other experts."""
        experts = self.experts
        if experts is not None and producer == self.norm_before(self.mlp):
            return (experts.router, *([experts.shared_gate] if experts.shared_gate else []))
        return ()

    def for_config(self, config: dict[str, Any]) -> DecoderLayout:
        """The layout of one model: a mixture of experts' names written out once per expert
        (its gates and ups in one group: with every token through every expert during
        calibration they read the same input; each down on its own)."""
        missing = [key for key in self.required_config if config.get(key) is None]
        if missing:
            raise UnsupportedModelError(
                f"model_type {config.get('model_type')!r} without {', '.join(missing)} in "
                "config.json is not supported"
            )
        if self.experts is None:
            return self
        count = self.experts.count(config)

        def names(group: tuple[str, ...]) -> tuple[str, ...]:
            per_expert = tuple(name for name in group if EXPERT in name)
            once = tuple(name for name in group if EXPERT not in name)  # a shared expert's
            return (
                tuple(name.replace(EXPERT, str(e)) for e in range(count) for name in per_expert)
                + once
            )

        sequential: list[tuple[str, ...]] = []
        for group in self.sequential:
            if len(group) == 1 and EXPERT in group[0]:  # each expert's down reads its own input
                sequential.extend((name,) for name in names(group))
            else:
                sequential.append(names(group))
        smooth: list[tuple[str, tuple[str, ...]]] = []
        for producer, consumers in self.smooth:
            if EXPERT in producer:  # one pairing per expert (its up -> its down)
                smooth.extend(
                    (producer.replace(EXPERT, str(e)), names(consumers)[e : e + 1])
                    for e in range(count)
                )
            else:
                smooth.append((producer, names(consumers)))
        return replace(
            self, sequential=tuple(sequential), smooth=tuple(smooth),
            dense_layers=_dense_layers(config),
        )  # fmt: skip

    def parts(self, linear: str) -> int:
        """How many projections `linear` holds in its output rows (1: not fused)."""
        return dict(self.fused_parts).get(linear, 1)

    def smoothing_pairs(self, smooth: float | str) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The pairings SmoothQuant scales: all of them for "auto" (its search may leave any
        unscaled), those of `fixed_alpha_producers` for a fixed alpha."""
        if smooth == "auto":
            return self.smooth
        return tuple(pair for pair in self.smooth if pair[0] in self.fixed_alpha_producers)

    @property
    def blocks(self) -> tuple[tuple[str, tuple[tuple[str, ...], ...]], ...]:
        """The layer's residual blocks in order (attention, MLP), each with its linear groups.

        A block's last group is its output projection: the block returns that linear's output
        (HF attention modules as `(output, weights)`), which is how the pipeline reuses a block's
        quantized output without running the block again.
        """
        return tuple(
            (block, tuple(group for group in self.sequential if group[0].startswith(f"{block}.")))
            for block in (self.attention, self.mlp)
        )

    def norm_before(self, block: str) -> str | None:
        """The norm whose output only `block` reads, first of all its linears (the producer
        pairing it with the block's first linear, when that is not a linear), or None."""
        groups = dict(self.blocks)[block]
        inside = {name for group in groups for name in group}
        for producer, consumers in self.smooth:
            if (
                consumers[0] == groups[0][0]
                and set(consumers) <= inside
                and producer not in self.linears
            ):
                return producer
        return None

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)

    def layer_prefix(self, index: int) -> str:
        return f"{self.layers}.{index}."

    def linear_names(self, index: int) -> list[str]:
        """Full module names of decoder layer `index`'s linears, in execution order."""
        return [self.layer_prefix(index) + suffix for suffix in self.at(index).linears]


def _dense_layers(config: dict[str, Any]) -> frozenset[int]:
    """The layers of a mixture-of-experts model that have a plain MLP, as transformers builds
    them: those of `mlp_only_layers`, those off the `decoder_sparse_step` (Qwen-MoE), the first
    `first_k_dense_replace` (DeepSeek-V3)."""
    only = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    first = int(config.get("first_k_dense_replace") or 0)
    layers = range(int(config["num_hidden_layers"]))
    return frozenset(i for i in layers if i in only or (i + 1) % step or i < first)
