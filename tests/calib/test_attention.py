"""causal_attention against a float64 reference and PyTorch's SDPA, and when the layer passes
use it instead of SDPA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import llmq.calib.attention as attention_module
import llmq.calib.stream as stream_module
from llmq.calib.attention import (
    BLOCKED_SEQ_LENGTHS,
    QUERY_BLOCK,
    blocked_causal_applies,
    causal_attention,
)
from llmq.calib.stream import LayerStream
from llmq.io.checkpoint import open_checkpoint


def _qkv(batch: int, heads: int, kv_heads: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, seq, 64), (batch, kv_heads, seq, 64), (batch, kv_heads, seq, 64)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The definition in float64: every query against every key, future keys masked."""
    share = query.shape[1] // key.shape[1]
    q, k, v = (t.double() for t in (query, key, value))
    k, v = k.repeat_interleave(share, dim=1), v.repeat_interleave(share, dim=1)
    seq = q.shape[2]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return (weights @ v).transpose(1, 2)  # [batch, seq, heads, head_dim]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq"),
    [(9, 3, 300), (4, 4, 2 * QUERY_BLOCK), (3, 1, QUERY_BLOCK - 5), (6, 2, 1)],
)
def test_equals_the_definition_and_sdpa(heads: int, kv_heads: int, seq: int) -> None:
    query, key, value = _qkv(2, heads, kv_heads, seq)
    got = causal_attention(query, key, value, 64**-0.5)
    assert got.shape == (2, seq, heads, 64) and got.dtype == torch.float32
    want = _reference(query, key, value)
    assert float((got.double() - want).abs().max()) < 2e-6
    sdpa = nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(got, sdpa, rtol=1e-5, atol=2e-6)


def test_the_first_query_reads_only_the_first_value() -> None:
    query, key, value = _qkv(1, 3, 1, 70, seed=1)
    got = causal_attention(query, key, value, 0.125)
    for head in range(3):
        torch.testing.assert_close(got[0, 0, head], value[0, 0, 0])


def test_refuses_keys_that_do_not_pair_with_the_queries() -> None:
    query, key, value = _qkv(1, 4, 3, 40)
    with pytest.raises(ValueError, match="do not pair"):
        causal_attention(query, key, value, 0.125)
    query, key, value = _qkv(1, 4, 2, 40)
    with pytest.raises(ValueError, match="do not pair"):
        causal_attention(query, key[:, :, :20], value[:, :, :20], 0.125)


def test_layer_passes_use_it_and_match_sdpa(tiny_llama: Path, monkeypatch) -> None:
    stream = LayerStream(open_checkpoint(tiny_llama), device="cpu", batch_size=2)
    layer = stream.load_layer(0)
    seq = max(BLOCKED_SEQ_LENGTHS)
    hidden = torch.randn(
        3, seq, stream.config.hidden_size, generator=torch.Generator().manual_seed(2)
    )
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return causal_attention(*args)

    monkeypatch.setattr(stream_module, "causal_attention", counted)
    blocked = stream.run_layer(layer, hidden)
    assert len(calls) == 2  # one per micro-batch
    monkeypatch.setattr(attention_module, "BLOCKED_SEQ_LENGTHS", frozenset())
    sdpa = stream.run_layer(layer, hidden)
    assert len(calls) == 2
    torch.testing.assert_close(blocked, sdpa, rtol=1e-5, atol=1e-5)


_BLOCKED = max(BLOCKED_SEQ_LENGTHS)


class _Attention(nn.Module):
    is_causal = True


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, True),
        ({"mask": torch.zeros(1)}, False),
        ({"device": "meta"}, False),
        ({"seq": _BLOCKED - 1}, False),
        ({"seq": _BLOCKED + 1}, False),
        ({"keys": _BLOCKED - 1}, False),
        ({"dropout": 0.1}, False),
        ({"sliding_window": 128}, False),
        ({"sliding_window": 4096}, True),
        ({"is_causal": False}, False),
        ({"softcap": 30.0}, False),
        ({"gradients": True}, False),  # a backward pass: SDPA's backward is one kernel
    ],
)
def test_dispatch_only_for_plain_causal_cpu_windows(change: dict, expected: bool) -> None:
    seq = change.get("seq", _BLOCKED)
    device = change.get("device", "cpu")
    query = torch.empty(1, 2, seq, 8, device=device)
    key = torch.empty(1, 2, change.get("keys", seq), 8, device=device)
    kwargs = {"scaling": 0.3, "dropout": 0.0}
    own = ("seq", "device", "keys", "mask", "gradients")
    kwargs.update({k: v for k, v in change.items() if k not in own})
    with torch.set_grad_enabled(change.get("gradients", False)):
        applies = blocked_causal_applies(_Attention(), query, key, change.get("mask"), kwargs)
    assert applies is expected


@pytest.mark.parametrize("kv_heads", [2, 8], ids=["gqa", "mha"])
def test_gpu_causal_attention_equals_transformers_sdpa(kv_heads: int) -> None:
    """The GPU path (keys and values repeated to the query's heads, then causal SDPA) computes
    what transformers' own SDPA attention computes, run here on CPU tensors."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from llmq.calib.attention import gpu_causal_applies, gpu_causal_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 8, 33, 16, generator=generator)
    key, value = (torch.randn(2, kv_heads, 33, 16, generator=generator) for _ in range(2))
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 8 // kv_heads, True
    expected, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.25)
    got = gpu_causal_attention(query, key, value, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not gpu_causal_applies(module, query, key, None, {})  # CPU tensors: not served
