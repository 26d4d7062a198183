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

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from llmq.errors import InputError


@dataclass(frozen=True, slots=True)
class GGUFArch:
    """How one Hugging Face family is written: its GGUF architecture and whether q/k rows are
    permuted."""

    arch: gguf.MODEL_ARCH
    permute_rotary: bool


ARCHS = {
    "llama": GGUFArch(gguf.MODEL_ARCH.LLAMA, permute_rotary=True),
    "mistral": GGUFArch(gguf.MODEL_ARCH.LLAMA, permute_rotary=True),
    "qwen2": GGUFArch(gguf.MODEL_ARCH.QWEN2, permute_rotary=False),
    "qwen3": GGUFArch(gguf.MODEL_ARCH.QWEN3, permute_rotary=False),
    # experts stacked in one 3-D tensor per role (ffn_gate_exps [experts, rows, cols] ...)
    "qwen3_moe": GGUFArch(gguf.MODEL_ARCH.QWEN3MOE, permute_rotary=False),
    "qwen2_moe": GGUFArch(gguf.MODEL_ARCH.QWEN2MOE, permute_rotary=False),  # + a shared expert
}
# Whether llama.cpp renormalizes the chosen experts' weights (norm_topk_prob) for the family: a
# checkpoint that says otherwise would compute another model there.
_RENORMALIZES = {"qwen3_moe": True, "qwen2_moe": False}
# Weights llama.cpp reads as vectors: Qwen2-MoE's shared-expert gate, [1, hidden] in the checkpoint
VECTORS = ("ffn_gate_inp_shexp.weight",)
# Architectures whose llama.cpp loader needs its own output.weight (no tied embedding):
# found by llama.cpp 11434 refusing a tied Qwen2-MoE file ("tensor 'output.weight' not found")
_SEPARATE_OUTPUT = ("qwen2_moe",)
# Where a checkpoint's per-expert name holds the expert's index (`mlp.experts.3.up_proj`): GGUF
# stacks the experts of a role into one tensor, named as the name without it.
EXPERT_INDEX = re.compile(r"(?<=\.experts)\.(\d+)(?=\.)")
# llama.cpp names a BPE tokenizer's pre-tokenizer (how text is split before merges) rather than
# storing its regex; these are the splits that tell the common ones apart, tried in order.
# A plain byte-level tokenizer (GPT-2's split, as SmolLM2's) is "gpt-2".
PRE_TOKENIZER_SPLITS = (
    ("gpt-4o", r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*"),
    ("llama-bpe", r"\p{N}{1,3}"),
    ("qwen2", r"|\p{N}|"),
)


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
    scaling = config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or (config.get("rope_parameters") or {}).get("rope_type")
    if rope_type not in (None, "default"):
        raise InputError(
            f"rope scaling {rope_type!r}: not written to GGUF by llmq yet",
            hint="models with default rotary embeddings convert",
        )
    return ARCHS[model_type]


class TensorNames:
    """Hugging Face tensor names -> GGUF names for one model."""

    def __init__(self, arch: GGUFArch, num_layers: int) -> None:
        self._map = gguf.get_tensor_name_map(arch.arch, num_layers)

    def gguf_name(self, hf_name: str) -> str:
        """The GGUF name of a tensor (of the stacked tensor, for one expert's)."""
        name = self._map.get_name(EXPERT_INDEX.sub("", hf_name), try_suffixes=(".weight", ".bias"))
        if name is None:
            raise InputError(f"{hf_name}: no GGUF tensor name for it in this architecture")
        return name


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


def write_hyperparameters(writer: gguf.GGUFWriter, config: Any) -> None:
    """The architecture's hyperparameters, from the transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    experts = getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if shared:
        writer.add_expert_shared_feed_forward_length(shared)
    # stated even where it is hidden / heads: readers take a family's default head size
    # otherwise (transformers' Qwen3 assumes 128)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def _rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise InputError("the config gives no rope_theta")
    return float(theta)


def pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, from the split regex in its
    tokenizer.json; "gpt-2" where it splits as GPT-2 does."""
    node = spec.get("pre_tokenizer") or {}
    parts = node.get("pretokenizers", [node]) if node.get("type") == "Sequence" else [node]
    for part in parts:
        regex = (part.get("pattern") or {}).get("Regex") if part.get("type") == "Split" else None
        if regex is None:
            continue
        for name, marker in PRE_TOKENIZER_SPLITS:
            if marker in regex:
                return name
        raise InputError(
            "the tokenizer splits text with a regex llmq does not know a llama.cpp name for",
            hint=f"known: {', '.join(name for name, _ in PRE_TOKENIZER_SPLITS)}, gpt-2",
        )
    return "gpt-2"


def write_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (tokenizer.json) as llama.cpp's "gpt2" model: every id's token
    and type, the merges, special ids and the chat template (`gguf.SpecialVocab`)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{folder}: no tokenizer.json", hint="GGUF files carry the tokenizer")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise InputError(
            f"{path}: a {model.get('type')} tokenizer; llmq writes byte-level BPE ones to GGUF"
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, index in model["vocab"].items():
        if index < vocab_size:
            tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        index = added["id"]
        if index < vocab_size:
            tokens[index] = added["content"]
            types[index] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)
