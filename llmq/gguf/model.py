"""What a GGUF file says about the model besides its weights, in llama.cpp's conventions: the
architecture, its hyperparameters, the tokenizer, and each tensor's GGUF name.

Names come from the gguf package's own table (`gguf.get_tensor_name_map`, the one llama.cpp's
converter uses). llama.cpp applies rotary embeddings to interleaved pairs of a head's dimensions
for the "llama" architecture, where Hugging Face rotates its two halves: the converter permutes
q_proj's and k_proj's rows so that each head's halves interleave (`permute_rotary_rows`), and
readers (llama.cpp, transformers' GGUF loader) expect that. Qwen's architectures rotate halves in
llama.cpp too ("NEOX" rope), so they are written as stored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from llmq.errors import InputError
from llmq.gguf.mla import write_latent_attention


@dataclass(frozen=True, slots=True)
class GGUFArch:
    """How one Hugging Face family is written: its GGUF architecture, whether q/k rows are
    permuted, and whether its runs of spaces are user-defined tokens (Gemma's tokenizer)."""

    arch: gguf.MODEL_ARCH
    permute_rotary: bool
    spaces_user_defined: bool = False
    transformers_reads: bool = True  # transformers' GGUF reader builds this family's model


ARCHS = {
    "llama": GGUFArch(gguf.MODEL_ARCH.LLAMA, permute_rotary=True),
    "mistral": GGUFArch(gguf.MODEL_ARCH.LLAMA, permute_rotary=True),
    "qwen2": GGUFArch(gguf.MODEL_ARCH.QWEN2, permute_rotary=False),
    "qwen3": GGUFArch(gguf.MODEL_ARCH.QWEN3, permute_rotary=False),
    # Phi-3: q/k/v in one attn_qkv, gate and up in one ffn_up (gate first), as stored
    "phi3": GGUFArch(gguf.MODEL_ARCH.PHI3, permute_rotary=False),
    # Gemma: norms of (1 + weight), stored with the 1 added (llama.cpp multiplies by the weight);
    # sliding-window layers with their own rotary base; Gemma 2 soft-caps its logits
    "gemma2": GGUFArch(gguf.MODEL_ARCH.GEMMA2, permute_rotary=False, spaces_user_defined=True),
    "gemma3_text": GGUFArch(gguf.MODEL_ARCH.GEMMA3, permute_rotary=False, spaces_user_defined=True),
    # experts stacked in one 3-D tensor per role (ffn_gate_exps [experts, rows, cols] ...)
    "qwen3_moe": GGUFArch(gguf.MODEL_ARCH.QWEN3MOE, permute_rotary=False),
    "qwen2_moe": GGUFArch(gguf.MODEL_ARCH.QWEN2MOE, permute_rotary=False),  # + a shared expert
    # transformers reads a llama file as a dense Llama and has no olmoe: llama.cpp verifies these
    "mixtral": GGUFArch(gguf.MODEL_ARCH.LLAMA, permute_rotary=True, transformers_reads=False),
    "olmoe": GGUFArch(gguf.MODEL_ARCH.OLMOE, permute_rotary=False, transformers_reads=False),
    # latent attention, kv_b split for llama.cpp's MLA (llmq.gguf.mla); rope on interleaved pairs
    # in both, so rows stay as stored
    "deepseek_v3": GGUFArch(
        gguf.MODEL_ARCH.DEEPSEEK2, permute_rotary=False, transformers_reads=False
    ),
    "kimi_k2": GGUFArch(gguf.MODEL_ARCH.DEEPSEEK2, permute_rotary=False, transformers_reads=False),
    # experts and their biases stacked from llmq's per-expert view of the fused tensors; sinks
    "gpt_oss": GGUFArch(gguf.MODEL_ARCH.GPT_OSS, permute_rotary=False, transformers_reads=False),
}
# Whether llama.cpp renormalizes the chosen experts' weights (norm_topk_prob) for the family: a
# checkpoint that says otherwise would compute another model there. (Mixtral's transformers
# code always renormalizes, as llama.cpp's llama does: it has no such field.)
_RENORMALIZES = {"qwen3_moe": True, "qwen2_moe": False, "olmoe": False}
# Weights llama.cpp reads as vectors: Qwen2-MoE's shared-expert gate, [1, hidden] in the checkpoint
VECTORS = ("ffn_gate_inp_shexp.weight",)
# Architectures whose llama.cpp loader needs its own output.weight (no tied embedding):
# found by llama.cpp 11434 refusing tied Qwen2-MoE, OLMoE and GPT-OSS files ("tensor 'output.weight' not found")
_SEPARATE_OUTPUT = ("qwen2_moe", "olmoe", "gpt_oss")
# ... and those whose loader ignores one: llama.cpp's gemma2 always reads token_embd as the head
_TIED_OUTPUT = ("gemma2",)
# Layer counts llama.cpp takes for the 27B Gemmas, whose queries it scales by 1/sqrt(hidden /
# heads) instead of 1/sqrt(head_dim) (llama.cpp's gemma2.cpp, gemma3.cpp)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
# Where a checkpoint's per-expert name holds the expert's index (`mlp.experts.3.up_proj`): GGUF
# stacks the experts of a role into one tensor, named as the name without it.
EXPERT_INDEX = re.compile(r"(?<=\.experts)\.(\d+)(?=\.)")


def gguf_arch(config: dict[str, Any]) -> GGUFArch:
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        raise InputError(
            f"model_type {model_type!r}: no GGUF mapping in llmq yet",
            hint=f"llmq writes GGUF for {', '.join(ARCHS)}",
        )
    if model_type in _SEPARATE_OUTPUT and config.get("tie_word_embeddings"):
        raise InputError(
            f"tie_word_embeddings true: llama.cpp's "
            f"{gguf.MODEL_ARCH_NAMES[ARCHS[model_type].arch]} reads a separate output.weight",
            hint="its released checkpoints have their own lm_head; a tied one is not converted",
        )
    renormalizes = _RENORMALIZES.get(str(model_type))
    if renormalizes is not None and bool(config.get("norm_topk_prob")) != renormalizes:
        raise InputError(
            f"norm_topk_prob {str(not renormalizes).lower()}: llama.cpp's "
            f"{gguf.MODEL_ARCH_NAMES[ARCHS[model_type].arch]} "
            f"{'always' if renormalizes else 'never'} renormalizes the chosen experts' weights, so "
            "the GGUF file would compute another model"
        )
    if model_type in _TIED_OUTPUT and not config.get("tie_word_embeddings", True):
        raise InputError(
            "tie_word_embeddings false: llama.cpp's gemma2 reads the embedding as the output "
            "projection, so the GGUF file would compute another model"
        )
    _check_query_scale(str(model_type), config)
    heads = config.get("num_attention_heads")
    if model_type == "olmoe" and config.get("num_key_value_heads", heads) != heads:
        raise InputError(
            "num_key_value_heads differs from num_attention_heads: llama.cpp's olmoe normalizes "
            "keys over as many heads as queries"
        )
    return ARCHS[model_type]


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def gguf_layer(name: str) -> int:
    """The decoder layer of a GGUF tensor name (blk.N...), -1 for the others."""
    found = _BLOCK.match(name)
    return -1 if found is None else int(found.group(1))


class TensorNames:
    """Hugging Face tensor names -> GGUF names for one model."""

    def __init__(self, arch: GGUFArch, num_layers: int) -> None:
        self._map = gguf.get_tensor_name_map(arch.arch, num_layers)

    def gguf_name(self, hf_name: str) -> str:
        """The GGUF name of a tensor (of the stacked tensor, for one expert's)."""
        mapped = EXPERT_INDEX.sub("", hf_name).replace("_correction_bias", "_correction.bias")
        name = self._map.get_name(mapped, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise InputError(f"{hf_name}: no GGUF tensor name for it in this architecture")
        # a parameter stored without a suffix (GPT-OSS's sinks) is a weight to llama.cpp
        return name if name.endswith((".weight", ".bias")) else f"{name}.weight"


def read_field(path: Path, key: str) -> Any:
    """A metadata value of a GGUF file; None when the file is no readable GGUF or lacks it."""
    try:
        field = gguf.GGUFReader(path).get_field(key)
    except (OSError, ValueError):
        return None
    return None if field is None else field.contents()


def permute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q_proj (`heads` query heads) or k_proj (key heads) reordered so that each head's
    two rotary halves interleave: row h·d + 2i + j takes row h·d + j·d/2 + i."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """`permute_rotary_rows`' inverse: each head's rotary halves back in Hugging Face's order."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True, slots=True)
class Rope:
    """The rotary embedding as llama.cpp is told it: the base of full-attention layers, that of
    sliding-window layers (None without them), and the full-attention layers' scaling (their
    `rope_parameters` when its type is linear, yarn or llama3; None: unscaled)."""

    theta: float
    swa_theta: float | None = None
    scaling: dict[str, Any] | None = None


# YaRN parameters llama.cpp's rope does not take (but its deepseek2 takes DeepSeek's attention
# scales when they are equal: then transformers' rope is unscaled and the softmax scale grows by
# mscale_all_dim's factor squared), and GPT-OSS's untruncated correction range
_YARN_UNSUPPORTED = ("mscale", "mscale_all_dim")


def rope_of(config: Any) -> Rope:
    """`config`'s rotary parameters (transformers' `rope_parameters`, per layer type where the
    family has several); InputError for what llama.cpp would compute differently. Full-attention
    layers may scale linearly, by YaRN, or as Llama 3.1 does (the llama architecture only: llama.cpp reads
    Llama 3's per-frequency factors as a tensor)."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if not parameters or not all(isinstance(value, dict) for value in parameters.values()):
        parameters = {"full_attention": parameters}
    full = parameters.get("full_attention") or {}
    sliding = parameters.get("sliding_attention")
    arch = ARCHS.get(getattr(config, "model_type", ""))
    for kind, part in parameters.items():
        _check_rope(kind, part, arch)
    theta = full.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise InputError("the config gives no rope_theta")
    scaled = full.get("rope_type", "default") != "default"
    swa_theta = None if sliding is None else float(sliding["rope_theta"])
    return Rope(float(theta), swa_theta, dict(full) if scaled else None)


def _check_rope(kind: str, part: dict[str, Any], arch: GGUFArch | None) -> None:
    rope_type = part.get("rope_type", "default")
    llama3 = rope_type == "llama3" and (arch is None or arch.arch == gguf.MODEL_ARCH.LLAMA)
    longrope = rope_type == "longrope" and (arch is None or arch.arch == gguf.MODEL_ARCH.PHI3)
    known = rope_type in ("default", "linear", "yarn") or llama3 or longrope
    where = "" if kind == "full_attention" else f" on {kind}"
    if not known or (rope_type != "default" and kind != "full_attention"):
        raise InputError(
            f"rope scaling {rope_type!r}{where}: not written to GGUF by llmq yet",
            hint="default, linear and YaRN rotary embeddings convert, Llama 3's and Phi-3's longrope",
        )
    unsupported = [key for key in _YARN_UNSUPPORTED if part.get(key)]
    deepseek = arch is not None and arch.arch == gguf.MODEL_ARCH.DEEPSEEK2
    if deepseek and part.get("mscale") == part.get("mscale_all_dim"):
        unsupported = []
    # llama.cpp truncates YaRN's correction range always; its GPT-OSS files (its converter's too)
    # compute GPT-OSS so, where transformers does not (docs/gguf.md, measured)
    untruncated = part.get("truncate") is False and not (arch is not None and arch.arch == gguf.MODEL_ARCH.GPT_OSS)  # fmt: skip
    if rope_type == "yarn" and (unsupported or untruncated):
        what = ", ".join(unsupported) or "truncate false"
        raise InputError(f"YaRN with {what}: llama.cpp's rope does not take it", hint="plain YaRN (Qwen's) converts")  # fmt: skip


def llama3_rope_factors(config: Any) -> np.ndarray:
    """Llama 3.1's rotary scaling as llama.cpp reads it (`rope_freqs.weight`, float32 [head_dim
    / 2]): each frequency's divisor, 1 above the high-frequency band, `factor` below the low one
    and a smooth blend between (transformers' `_compute_llama3_parameters`)."""
    rope = rope_of(config)
    scaling = rope.scaling or {}
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    freqs = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * np.pi / freqs
    smooth = (context / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelength < context / high, 1.0, np.where(wavelength > context / low, factor, blended))  # fmt: skip
    return factors.astype(np.float32)


def longrope_attention_factor(config: Any) -> float:
    """Phi-3's longrope scale of cos and sin, as transformers computes it (its own rope
    initializer, so that the file states the model transformers runs)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    return float(factor)


def _check_query_scale(model_type: str, config: dict[str, Any]) -> None:
    """Gemma scales queries by 1/sqrt(query_pre_attn_scalar); llama.cpp by a rule of its own
    (1/sqrt(hidden / heads) for the 27B models it knows by layer count, else 1/sqrt(head_dim)):
    a checkpoint the rule does not fit is refused."""
    scalar = config.get("query_pre_attn_scalar")
    if scalar is None or model_type not in _GEMMA_27B_LAYERS:
        return
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    big = int(config["num_hidden_layers"]) == _GEMMA_27B_LAYERS[model_type]
    used = hidden / heads if big else head_dim
    if float(scalar) != float(used):
        raise InputError(
            f"query_pre_attn_scalar {scalar}: llama.cpp scales this model's queries by "
            f"1/sqrt({used:g}), so the GGUF file would compute another model"
        )


def write_hyperparameters(writer: gguf.GGUFWriter, config: Any, arch: GGUFArch) -> None:
    """The architecture's hyperparameters, from the transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = rope_of(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_rope_freq_base(rope.theta)
    _write_rope_scaling(writer, config, rope.scaling)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch.arch == gguf.MODEL_ARCH.DEEPSEEK2:
        write_latent_attention(writer, config)
        return
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_dimension_count(rotary_dims(config))
    if arch.arch == gguf.MODEL_ARCH.PHI3:  # llama.cpp's phi3 reads a window, 0 for none
        writer.add_sliding_window(getattr(config, "sliding_window", None) or 0)
    _write_experts(writer, config)
    _write_windows_and_caps(writer, config, rope)
    # stated even where it is hidden / heads: readers take a family's default head size
    # otherwise (transformers' Qwen3 assumes 128)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def rotary_dims(config: Any) -> int:
    """How many of a head's dimensions rotate (all but where `partial_rotary_factor` < 1)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    partial = partial or getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * partial)


def _write_rope_scaling(
    writer: gguf.GGUFWriter, config: Any, scaling: dict[str, Any] | None
) -> None:
    """Linear and YaRN scaling as llama.cpp's keys, longrope's attention factor (its per-frequency
    factors, like Llama 3's, are tensors: `derived_tensors`)."""
    kind = None if scaling is None else scaling["rope_type"]
    if kind == "longrope":  # the original context picks long or short factors in both
        assert scaling is not None
        original = getattr(config, "original_max_position_embeddings", None)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        writer.add_rope_scaling_orig_ctx_len(int(original or scaling["original_max_position_embeddings"]))  # fmt: skip
        writer.add_rope_scaling_attn_factors(longrope_attention_factor(config))
        return
    if kind not in ("linear", "yarn"):
        return
    assert scaling is not None
    writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    if kind == "linear":
        return
    writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    for key, add in (
        ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
        ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
        ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
    ):
        if scaling.get(key) is not None:
            add(float(scaling[key]))
    if scaling.get("mscale_all_dim"):  # DeepSeek's softmax scale (llama.cpp's deepseek2)
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(scaling["mscale_all_dim"]))


def _write_experts(writer: gguf.GGUFWriter, config: Any) -> None:
    """A mixture's expert count, experts per token and expert width (Mixtral and OLMoE call
    theirs intermediate_size); a shared expert's width."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        writer.add_expert_feed_forward_length(width)
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if shared:
        writer.add_expert_shared_feed_forward_length(shared)


def _write_windows_and_caps(writer: gguf.GGUFWriter, config: Any, rope: Rope) -> None:
    """Sliding-window layers (window, which layers, their rotary base) and soft-capping."""
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in layer_types])
        writer.add_rope_freq_base_swa(rope.swa_theta if rope.swa_theta is not None else rope.theta)
    for key, add in (
        ("attn_logit_softcapping", writer.add_attn_logit_softcapping),
        ("final_logit_softcapping", writer.add_final_logit_softcapping),
    ):
        value = getattr(config, key, None)
        if value is not None:
            add(float(value))
