"""Greedy decoding with a KV cache, timed: the smoke test of a loaded checkpoint (`llmq
generate`) and the end-to-end decode measurement of `llmq bench`."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class Decoded:
    tokens: list[int]  # the new tokens, prompt excluded
    prefill_seconds: float  # the prompt's forward pass, first new token included
    decode_seconds: float  # every later token, one forward pass each

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second: the first comes out of the prefill."""
        return (len(self.tokens) - 1) / max(self.decode_seconds, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def greedy_decode(
    model: nn.Module,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> Decoded:
    """Greedy continuation of input_ids [1, T]: argmax of each step's logits, stopping at EOS
    (never when eos_token_id is None, as benchmarks want a fixed token count)."""
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    started = time.perf_counter()
    out = model(ids, use_cache=True)
    token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
    _sync(device)
    prefill = time.perf_counter() - started
    tokens = [int(token)]
    started = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        out = model(token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(int(token))  # int() waits for the GPU: the step is really done
    decode = time.perf_counter() - started
    return Decoded(tokens=tokens, prefill_seconds=prefill, decode_seconds=decode)
