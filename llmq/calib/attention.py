"""Causal self-attention for the CPU layer passes, block by block of queries.

PyTorch's CPU flash kernel (SDPA) splits keys in blocks of 512: for windows of 512 tokens it
multiplies every query by every key and masks half of the products away. Here each block of
queries multiplies only the keys at or before it, and the heads that share a key/value head
(GQA) are multiplied as one. On SmolLM2-135M's layers (9 query and 3 key/value heads), over
128 windows of 512 tokens on two cores: a whole layer pass 3.23-3.28 s against 3.34-3.40 s,
and 0.15 s less of a 6.5 s GPTQ layer.

    query: [batch, heads, seq, head_dim]; key, value: [batch, kv_heads, seq, head_dim]
    output: [batch, seq, heads, head_dim] (transformers' attention output layout)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

QUERY_BLOCK = 32
"""Queries per block: the products skipped grow as blocks shrink, the per-op overhead too."""
BLOCKED_SEQ_LENGTHS = frozenset({512})
"""Window lengths where whole layer passes measured faster than with SDPA: 512 tokens, the
default calibration and evaluation window. At 256 tokens SDPA was faster, at 384 they tied
within noise, and from 640 on SDPA's kernel skips masked key blocks itself and wins."""


def causal_attention(query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """softmax(scaling · Q Kᵀ + causal mask) V, equal to SDPA with is_causal=True up to float
    rounding (queries and keys of the same length)."""
    batch, heads, seq, head_dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[2] != seq or heads % kv_heads:
        raise ValueError(
            f"causal_attention: query {tuple(query.shape)} and key {tuple(key.shape)} do not pair"
        )
    share = heads // kv_heads
    grouped = (query * scaling).view(batch, kv_heads, share, seq, head_dim)
    output = query.new_empty(batch, seq, kv_heads, share, value.shape[-1])
    masked = torch.full((QUERY_BLOCK, QUERY_BLOCK), float("-inf"), device=query.device)
    masked = masked.triu(1).to(query.dtype)
    for start in range(0, seq, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, seq)
        size = end - start
        block = grouped[:, :, :, start:end].reshape(batch, kv_heads, share * size, head_dim)
        scores = torch.matmul(block, key[:, :, :end].transpose(-1, -2))
        scores.view(batch, kv_heads, share, size, end)[..., start:end] += masked[:size, :size]
        weights = torch.softmax(scores, dim=-1)
        mixed = torch.matmul(weights, value[:, :, :end])
        output[:, start:end] = mixed.view(batch, kv_heads, share, size, -1).permute(0, 3, 1, 2, 4)
    return output.view(batch, seq, heads, -1)


def blocked_causal_applies(
    module: torch.nn.Module, query: Tensor, key: Tensor, mask: Tensor | None, kwargs: dict[str, Any]
) -> bool:
    """Whether `causal_attention` can stand in for SDPA in a transformers attention call: plain
    causal self-attention over windows of BLOCKED_SEQ_LENGTHS tokens on the CPU (the layer
    passes call layers with no mask), nothing SDPA would do differently asked for, and no
    gradient wanted (its backward would run block by block: SDPA's is one kernel)."""
    seq = query.shape[2]
    window = kwargs.get("sliding_window")
    return (
        query.device.type == "cpu"
        and not torch.is_grad_enabled()
        and mask is None
        and seq in BLOCKED_SEQ_LENGTHS
        and key.shape[2] == seq
        and getattr(module, "is_causal", True)
        and kwargs.get("is_causal") is not False
        and not kwargs.get("dropout")
        and kwargs.get("scaling") is not None
        and (window is None or window >= seq)
        and not needs_eager(kwargs)
        and all(kwargs.get(name) is None for name in ("position_bias", "cache"))
    )


def needs_eager(kwargs: dict[str, Any]) -> bool:
    """Whether an attention call asks for what SDPA cannot do, so the family's own eager
    attention runs it: capped logits (Gemma 2) or attention sinks (GPT-OSS's `s_aux`)."""
    return kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None


def needs_explicit_mask(query: Tensor, key: Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a layer pass (called with no mask: SDPA masks causally itself) needs a mask:
    a sliding window shorter than the keys (Mistral, Qwen2, Gemma's local layers), or the
    family's eager attention (`needs_eager`), which masks nothing by itself."""
    window = kwargs.get("sliding_window")
    sliding = window is not None and window < key.shape[2]
    return query.shape[2] > 1 and (sliding or needs_eager(kwargs))


def causal_mask(query: Tensor, key: Tensor, window: int | None) -> Tensor:
    """The additive mask [1, 1, queries, keys] of causal attention, the queries being the last
    positions of the keys; with a `window`, each query also sees only the `window` latest keys
    (itself included), as transformers' sliding-window masks do."""
    queries, keys = query.shape[2], key.shape[2]
    position = torch.arange(keys - queries, keys, device=query.device).unsqueeze(1)
    key_position = torch.arange(keys, device=query.device).unsqueeze(0)
    allowed = key_position <= position
    if window is not None:
        allowed &= position - key_position < window
    mask = torch.zeros(queries, keys, dtype=query.dtype, device=query.device)
    return mask.masked_fill(~allowed, torch.finfo(query.dtype).min)[None, None]


def gpu_causal_applies(
    module: nn.Module, query: Tensor, key: Tensor, mask: Tensor | None, kwargs: dict[str, Any]
) -> bool:
    """An unmasked causal window of equal query and key length on a GPU, with nothing that
    needs the eager attention: what `gpu_causal_attention` serves."""
    return (
        query.is_cuda
        and mask is None
        and not needs_eager(kwargs)
        and query.shape[2] == key.shape[2]
        and getattr(module, "is_causal", True)
    )


def gpu_causal_attention(
    query: Tensor, key: Tensor, value: Tensor, scaling: float | None
) -> Tensor:
    """Causal SDPA with the keys and values repeated to the query's heads, output [batch, seq,
    heads, dim] as transformers' attention functions return it.

    transformers hands grouped-query attention to SDPA as `enable_gqa`, which the
    memory-efficient kernel does not take, and float32 (llmq's calibration dtype) rules out the
    flash kernel: SDPA falls back to its math kernel, which materializes every head's
    [seq, seq] scores. On an H200 that was about 10 GB of transient memory for 4 windows of
    2,048 tokens of a Llama-3-8B layer. Repeated keys and values (a quarter of the scores' size
    there) let the memory-efficient kernel run."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling
    )
    return output.transpose(1, 2).contiguous()
