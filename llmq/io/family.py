"""What llmq knows about each decoder-only family, as data: one table of module names.

Every family listed here stores its weights under the same Hugging Face names
(`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ...). Algorithms ask this table which
linears share an input and which norm feeds them; nothing else in llmq names a module.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmq.errors import UnsupportedModelError


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
        """The norm whose output only `block` reads (the producer of its first group, when that
        is not a linear), or None."""
        groups = dict(self.blocks)[block]
        for producer, consumers in self.smooth:
            if consumers == groups[0] and producer not in self.linears:
                return producer
        return None

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)

    def layer_prefix(self, index: int) -> str:
        return f"{self.layers}.{index}."

    def linear_names(self, index: int) -> list[str]:
        """Full module names of decoder layer `index`'s linears, in execution order."""
        return [self.layer_prefix(index) + suffix for suffix in self.linears]


_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP_IN = ("mlp.gate_proj", "mlp.up_proj")
_LLAMA_LIKE = DecoderLayout(
    embed="model.embed_tokens",
    layers="model.layers",
    final_norm="model.norm",
    lm_head="lm_head",
    rotary="model.rotary_emb",
    attention="self_attn",
    mlp="mlp",
    sequential=(_ATTENTION, ("self_attn.o_proj",), _MLP_IN, ("mlp.down_proj",)),
    smooth=(
        ("input_layernorm", _ATTENTION),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", _MLP_IN),
        ("mlp.up_proj", ("mlp.down_proj",)),
    ),
    fixed_alpha_producers=("input_layernorm", "self_attn.v_proj", "post_attention_layernorm"),
)

FAMILY_LAYOUT: dict[str, DecoderLayout] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
}


def layout_for(model_type: str | None) -> DecoderLayout:
    """The layout of a `model_type` from config.json; an unknown one names the supported ones."""
    try:
        return FAMILY_LAYOUT[str(model_type)]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported",
            hint=f"supported: {', '.join(sorted(FAMILY_LAYOUT))}",
        ) from None
