"""DeepSeek-V3's multi-head latent attention (and Kimi K2's, built as it) in llama.cpp's layout.

llama.cpp's deepseek2 runs MLA with the absorption trick: keys are never decompressed, so it
wants `kv_b_proj` [heads x (qk_nope + v_head), kv_lora] split per head into
`attn_k_b` [heads, kv_lora, qk_nope] (the key part, transposed: it multiplies the queries'
non-rotary part into the latent space) and `attn_v_b` [heads, v_head, kv_lora], as its converter
writes them; the KV cache then holds one latent of kv_lora + qk_rope per token ("MQA with one
large head", hence head_count_kv 1 and key/value lengths of the latent). The real head sizes are
the `_mla` lengths. A reader joins the two back (`join_kv_b`).

The experts route by sigmoid scores plus a per-expert correction bias (`exp_probs_b`), within
`n_group` groups of which `topk_group` are kept, renormalized (`norm_topk_prob`) and scaled by
`routed_scaling_factor`; the first `first_k_dense_replace` layers are dense.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

K_B, V_B = "k_b", "v_b"  # the shares of kv_b_proj llama.cpp stores apart
KV_B_SUFFIX = ".attn_kv_b.weight"


def latent_dims(config: Any) -> tuple[int, int, int]:
    """Heads, the non-rotary key size and the value size of one head."""
    return config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim


def split_kv_b(weight: np.ndarray, part: str, config: Any) -> np.ndarray:
    """`part` of kv_b_proj's weight [heads x (qk_nope + v_head), kv_lora]: the key share
    transposed [heads, kv_lora, qk_nope], or the value share [heads, v_head, kv_lora]."""
    heads, nope, value = latent_dims(config)
    per_head = weight.reshape(heads, nope + value, weight.shape[-1])
    if part == K_B:
        return np.ascontiguousarray(per_head[:, :nope].swapaxes(1, 2))
    return np.ascontiguousarray(per_head[:, nope:])


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """`split_kv_b`'s inverse: kv_b_proj's weight from the two shares."""
    joined = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
    return joined.reshape(-1, joined.shape[-1])


def part_shapes(config: Any) -> dict[str, tuple[int, int, int]]:
    heads, nope, value = latent_dims(config)
    return {K_B: (heads, config.kv_lora_rank, nope), V_B: (heads, value, config.kv_lora_rank)}


def part_name(kv_b_name: str, part: str) -> str:
    return kv_b_name.removesuffix(KV_B_SUFFIX) + f".attn_{part}.weight"


def write_latent_attention(writer: gguf.GGUFWriter, config: Any) -> None:
    """DeepSeek-V3's attention and routing hyperparameters, as llama.cpp's converter states them."""
    rope, latent = config.qk_rope_head_dim, config.kv_lora_rank
    writer.add_head_count_kv(1)  # one latent per token in llama.cpp's cache
    writer.add_rope_dimension_count(rope)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(latent)
    writer.add_key_length(latent + rope)
    writer.add_value_length(latent)
    writer.add_key_length_mla(config.qk_nope_head_dim + rope)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts or 0)
    writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
