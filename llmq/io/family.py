"""What llmq knows about each decoder-only family, as data: one table of module names.

Each family's `DecoderLayout` (llmq.io.layout) names its embedding, layers, norms and linears as
its checkpoints do. Algorithms ask this table which linears share an input, which norm or linear
feeds them and which axis structured pruning slices; the layer stream asks it where the layers
are. Nothing else in llmq names a module.

Adding a family is one entry in FAMILY_LAYOUT (a new `DecoderLayout` where its names differ; its
`structured` roles None where `prune --structured` cannot slice it) plus tests: those of
tests/io/test_family.py, tests/pruning/test_structured.py, tests/calib/test_norm.py and
tests/pipeline/test_quantize.py's reload test take every entry of the table.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from llmq.errors import UnsupportedModelError
from llmq.io.layout import EXPERT, DecoderLayout, Experts, StructuredRoles

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
    structured=StructuredRoles(
        query="self_attn.q_proj",
        key_value=("self_attn.k_proj", "self_attn.v_proj"),
        attention_output="self_attn.o_proj",
        mlp_input=_MLP_IN,
        mlp_output="mlp.down_proj",
        norms=("input_layernorm", "post_attention_layernorm"),
    ),
)


def _mixture(
    experts: Experts, mlp: str = "mlp", dense: DecoderLayout = _LLAMA_LIKE
) -> DecoderLayout:
    """`dense`'s attention, a mixture of experts (and a shared expert, where the family has
    one) for the MLP; `dense` is also the layout of the model's plain-MLP layers, if any. The
    experts of a layer read one norm's output, so AWQ and SmoothQuant scale them as one group,
    the scale folded into that norm."""
    shared_in: tuple[str, ...] = ()
    shared_down: tuple[tuple[str, ...], ...] = ()
    shared_pair: tuple[tuple[str, tuple[str, ...]], ...] = ()
    if experts.shared is not None:  # a plain gated MLP every token takes
        shared_in = (f"{experts.shared}.gate_proj", f"{experts.shared}.up_proj")
        shared_down = ((f"{experts.shared}.down_proj",),)
        shared_pair = ((shared_in[1], shared_down[0]),)
    readers = (experts.linear("gate"), experts.linear("up"), *shared_in)
    down = experts.linear("down")
    in_attention = f"{dense.attention}."
    attention = tuple(group for group in dense.sequential if group[0].startswith(in_attention))
    attention_pairs = tuple(pair for pair in dense.smooth if pair[1][0].startswith(in_attention))
    return replace(
        dense,
        mlp=mlp,
        sequential=(*attention, readers, (down,), *shared_down),
        smooth=(
            *attention_pairs,
            (dense.norm_before(dense.mlp) or "post_attention_layernorm", readers),
            (experts.linear("up"), (down,)),
            *shared_pair,
        ),
        structured=None,
        experts=experts,
        dense=dense,
    )


_QWEN3_MOE_EXPERTS = Experts(
    module="mlp.experts", router="mlp.gate", gate="gate_proj", up="up_proj", down="down_proj"
)
# Qwen3-MoE, and OLMoE, which names its experts alike.
_QWEN3_MOE = _mixture(_QWEN3_MOE_EXPERTS)
# Qwen2-MoE: the same experts plus a shared expert reading the same norm (and biased q/k/v).
_QWEN2_MOE = _mixture(
    replace(_QWEN3_MOE_EXPERTS, shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate")
)
# Mixtral: Mistral's attention; experts named w1 (gate), w3 (up), w2 (down) in block_sparse_moe.
_MIXTRAL = _mixture(
    Experts(
        module="block_sparse_moe.experts", router="block_sparse_moe.gate", gate="w1", up="w3",
        down="w2", loaded_as="mlp",
    ),
    mlp="block_sparse_moe",
)  # fmt: skip

# DeepSeek-V3: multi-head latent attention. Queries go through
# a low-rank q_a -> norm -> q_b, keys and values through kv_a (shared with a rotary key part) ->
# norm -> kv_b; q_a and kv_a read the layer's input norm. Each is its own group, in execution
# order (q_a and kv_a compute the same statistics, a small price for staying in order). The
# first `first_k_dense_replace` layers have a plain MLP: this layout; the rest, experts.
_MLA_INPUT = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")
_DEEPSEEK_DENSE = replace(
    _LLAMA_LIKE,
    sequential=(
        ("self_attn.q_a_proj",), ("self_attn.q_b_proj",), ("self_attn.kv_a_proj_with_mqa",),
        ("self_attn.kv_b_proj",), ("self_attn.o_proj",), _MLP_IN, ("mlp.down_proj",),
    ),
    smooth=(
        ("input_layernorm", _MLA_INPUT),
        ("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
        ("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
        ("post_attention_layernorm", _MLP_IN),
        ("mlp.up_proj", ("mlp.down_proj",)),
    ),
    fixed_alpha_producers=(
        "input_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm",
        "post_attention_layernorm",
    ),
    structured=None,
    latent_attention=True,
    required_config=("q_lora_rank",),
)  # fmt: skip
_DEEPSEEK_V3 = _mixture(
    Experts(
        module="mlp.experts", router="mlp.gate", gate="gate_proj", up="up_proj",
        down="down_proj", shared="mlp.shared_experts", count_keys=("n_routed_experts",),
    ),
    dense=_DEEPSEEK_DENSE,
)  # fmt: skip

# GPT-OSS: biased attention with sinks (run by its own eager attention), sliding-window layers,
# biased experts stored fused (`Experts.fused_gate_up`), routed by `mlp.router`. Its experts'
# activation, (clamp(up) + 1) · glu(clamp(gate)), is not linear in up, so no scale folds from
# up_proj into down_proj: the MLP's norm is its only pairing.
_GPT_OSS_EXPERTS = Experts(
    module="mlp.experts", router="mlp.router", gate="gate_proj", up="up_proj", down="down_proj",
    fused_gate_up="gate_up_proj", fused_down="down_proj",
)  # fmt: skip
_GPT_OSS_MIXTURE = _mixture(_GPT_OSS_EXPERTS)
_GPT_OSS = replace(
    _GPT_OSS_MIXTURE,
    smooth=tuple(pair for pair in _GPT_OSS_MIXTURE.smooth if EXPERT not in pair[0]),
)

# Gemma 2 and 3: four norms a layer (the two before the attention and the MLP feed the linears;
# the two after scale the blocks' outputs), norms of (1 + weight), Llama's linears. Structured
# pruning would have to slice the post-norms and q/k norms too: not supported.
_GEMMA = replace(
    _LLAMA_LIKE,
    smooth=(
        ("input_layernorm", _ATTENTION),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("pre_feedforward_layernorm", _MLP_IN),
        ("mlp.up_proj", ("mlp.down_proj",)),
    ),
    fixed_alpha_producers=("input_layernorm", "self_attn.v_proj", "pre_feedforward_layernorm"),
    structured=None,
    norm_weight_offset=1.0,
)

# Phi-3: q, k and v in one linear, gate and up in another (one scheme per fused tensor, as the
# checkpoint stores them). Scales fold through the fusion into v's and up's rows.
_PHI3_QKV, _PHI3_GATE_UP = ("self_attn.qkv_proj",), ("mlp.gate_up_proj",)
_PHI3 = replace(
    _LLAMA_LIKE,
    sequential=(_PHI3_QKV, ("self_attn.o_proj",), _PHI3_GATE_UP, ("mlp.down_proj",)),
    smooth=(
        ("input_layernorm", _PHI3_QKV),
        (_PHI3_QKV[0], ("self_attn.o_proj",)),
        ("post_attention_layernorm", _PHI3_GATE_UP),
        (_PHI3_GATE_UP[0], ("mlp.down_proj",)),
    ),
    fixed_alpha_producers=("input_layernorm", _PHI3_QKV[0], "post_attention_layernorm"),
    structured=None,
    fused_parts=((_PHI3_QKV[0], 3), (_PHI3_GATE_UP[0], 2)),
)

FAMILY_LAYOUT: dict[str, DecoderLayout] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "qwen3_moe": _QWEN3_MOE,
    "olmoe": _QWEN3_MOE,  # names its experts and router as Qwen3-MoE does
    "qwen2_moe": _QWEN2_MOE,
    "mixtral": _MIXTRAL,
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "phi3": _PHI3,
    "deepseek_v3": _DEEPSEEK_V3,
    "gpt_oss": _GPT_OSS,
    "kimi_k2": _DEEPSEEK_V3,
}
# model_types whose config.json asks for remote code though transformers knows the architecture:
# llmq builds them as that architecture (vLLM serves Kimi K2 as DeepseekV3ForCausalLM too); the
# checkpoint written keeps its own model_type.
BUILT_AS = {"kimi_k2": "deepseek_v3"}


# The last name part of a 2-D weight's module that is not a linear to quantize, in a family
# llmq cannot lay out: embeddings, the LM head (and a classifier's score), norms, and routers
# (a mixture's gate, a shared expert's gate). `gate_proj` and the like are linears.
_NOT_A_LINEAR = re.compile(
    r"embed\w*|wte|wpe|tok_embeddings|lm_head|output|score|\w*norm\w*|ln_\w*|\w*router\w*|(\w+_)?gate"
)


def is_linear_weight(module: str) -> bool:
    """Whether a 2-D weight of `module` (e.g. `model.layers.0.mlp.up_proj`) is a linear
    model-free conversion quantizes when no layout names the linears."""
    return _NOT_A_LINEAR.fullmatch(module.rpartition(".")[2]) is None


def layout_for_config(config: dict[str, Any]) -> DecoderLayout:
    """The layout of the model `config` (config.json) describes: its family's from the table,
    written out for it, or one found from transformers' module tree (llmq.io.discover)."""
    layout = FAMILY_LAYOUT.get(str(config.get("model_type")))
    if layout is None:
        from llmq.io.discover import discover_layout

        return discover_layout(config, sorted(FAMILY_LAYOUT))
    return layout.for_config(config)


def stores_fused_experts(config: dict[str, Any]) -> bool:
    """Whether the family of `config` stores its experts fused (GPT-OSS): only the layer
    pipeline splits them into linears and writes them back."""
    layout = FAMILY_LAYOUT.get(str(config.get("model_type")))
    return layout is not None and layout.experts is not None and layout.experts.stored_fused


def transposed_weights(config: dict[str, Any]) -> re.Pattern[str] | None:
    """The names of the weights `config`'s family stores as the transpose of a linear's,
    [..., in, out] (GPT-OSS's fused float experts); None where it stores none."""
    if not stores_fused_experts(config):
        return None
    layout = FAMILY_LAYOUT[str(config.get("model_type"))]
    experts = layout.experts
    assert experts is not None
    fused = "|".join(re.escape(str(name)) for name in (experts.fused_gate_up, experts.fused_down))
    return re.compile(rf"{re.escape(layout.layers)}\.\d+\.{re.escape(experts.module)}\.({fused})")


def layout_for(model_type: str | None) -> DecoderLayout:
    """The layout of a `model_type` from config.json; an unknown one names the supported ones."""
    try:
        return FAMILY_LAYOUT[str(model_type)]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported",
            hint=f"supported: {', '.join(sorted(FAMILY_LAYOUT))}",
        ) from None
