"""KV cache scales: observed on the keys after the rotary embedding (what the cache holds),
applied as per-tensor quantize-dequantize of keys and values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llmq.calib.stream import LayerStream, kv_hook
from llmq.config import QuantArgs
from llmq.io.checkpoint import open_checkpoint
from llmq.quant.kvcache import KVQuantizer, KVRange
from llmq.quant.primitives import FP8_MAX


def keys_and_values(stream: LayerStream, layer: torch.nn.Module, hidden: torch.Tensor):
    """An independent recomputation of what attention caches: k after RoPE, and v."""
    attention = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    q = attention.q_proj(x).view(shape).transpose(1, 2)
    k = attention.k_proj(x).view(shape).transpose(1, 2)
    v = attention.v_proj(x).view(shape).transpose(1, 2)
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    cos, sin = stream._rotary(hidden, positions)
    _, k = apply_rotary_pos_emb(q, k, cos, sin)
    return k, v


def test_kv_range_sees_keys_after_rotary_embedding(tiny_llama: Path) -> None:
    stream = LayerStream(open_checkpoint(tiny_llama), device="cpu")
    layer = stream.load_layer(0)
    hidden = torch.randn(
        2, 40, stream.config.hidden_size, generator=torch.Generator().manual_seed(3)
    )
    observed = KVRange()
    with kv_hook(layer.self_attn, observed):
        stream.run_layer(layer, hidden)
    with torch.no_grad():
        k, v = keys_and_values(stream, layer, hidden)
        pre_rope = layer.self_attn.k_proj(layer.input_layernorm(hidden))
    assert float(observed.key_absmax) == pytest.approx(float(k.abs().max()), rel=1e-6)
    assert float(observed.value_absmax) == pytest.approx(float(v.abs().max()), rel=1e-6)
    assert float(observed.key_absmax) != pytest.approx(float(pre_rope.abs().max()), rel=1e-3)


@pytest.mark.parametrize("kind", ["float", "int"])
def test_kv_quantizer_changes_attention_by_the_scales(tiny_llama: Path, kind: str) -> None:
    """The hook's keys and values are the scaled codes; a scale that is too small saturates."""
    args = QuantArgs(num_bits=8, type=kind, strategy="tensor")
    key = torch.randn(1, 2, 5, 8)
    value = torch.randn(1, 2, 5, 8)
    limit = FP8_MAX if kind == "float" else 127
    fit = KVQuantizer(
        args, key.abs().max().reshape(1) / limit, value.abs().max().reshape(1) / limit
    )
    k, v = fit(key, value)
    assert 0 < float((k - key).norm() / key.norm()) < 0.05
    assert 0 < float((v - value).norm() / value.norm()) < 0.05
    tiny = KVQuantizer(args, torch.tensor([1e-4]), torch.tensor([1e-4]))
    k, _ = tiny(key, value)
    lowest = -FP8_MAX if kind == "float" else -128  # int8 codes run from -128 to 127
    assert float(k.max()) == pytest.approx(1e-4 * limit, rel=1e-6)
    assert float(k.min()) == pytest.approx(1e-4 * lowest, rel=1e-6)
