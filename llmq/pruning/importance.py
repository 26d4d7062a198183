"""Structured importance (Minitron, arXiv 2407.14679): how much each attention head, key-value
group, MLP channel, hidden channel and whole layer contributes, from activations of the dense
model on calibration windows (forward passes only). Pure functions over statistics the layer
pipeline collects: per-input sums of squares of a linear's input (`InputStats.sq_sum`) and, for
layers, the cosine of each token's hidden state before and after the layer.

Aggregation: the L2 norm over all calibration tokens of the activation a unit produces (a head's
output before o_proj, the activation entering down_proj for an MLP channel, the RMSNorm output
for a hidden channel), so that a unit that is large on few tokens and one that is moderate on
many are ranked by the energy they carry.
"""

from __future__ import annotations

import torch
from torch import Tensor


def channel_importance(sq_sum: Tensor) -> Tensor:
    """[in] the L2 norm over tokens of each input channel of a linear (an MLP channel: the
    input of down_proj; a hidden channel: the input of q/k/v or gate/up, the RMSNorm output)."""
    return sq_sum.double().clamp_min(0).sqrt()


def head_importance(o_proj_sq_sum: Tensor, num_heads: int) -> Tensor:
    """[num_heads] the L2 norm over tokens of each head's output, from the sums of squares of
    o_proj's input (the heads' outputs side by side, head_dim columns each)."""
    if o_proj_sq_sum.numel() % num_heads:
        raise ValueError(f"{o_proj_sq_sum.numel()} inputs do not split into {num_heads} heads")
    per_head = o_proj_sq_sum.double().reshape(num_heads, -1).sum(dim=1)
    return per_head.clamp_min(0).sqrt()


def kv_group_importance(heads: Tensor, num_kv_heads: int) -> Tensor:
    """[num_kv_heads] a key-value group's query heads together (kept or removed whole, so that
    grouped-query attention stays valid): the L2 norm of their outputs."""
    if heads.numel() % num_kv_heads:
        raise ValueError(f"{heads.numel()} heads do not split into {num_kv_heads} groups")
    return heads.double().square().reshape(num_kv_heads, -1).sum(dim=1).sqrt()


def hidden_importance(norm_sq_sums: list[Tensor]) -> Tensor:
    """[hidden] each hidden (embedding) channel over every RMSNorm output that reads it (both
    norms of every layer): the L2 norm over all of them."""
    return torch.stack([s.double() for s in norm_sq_sums]).sum(dim=0).clamp_min(0).sqrt()


def block_importance(inputs: Tensor, outputs: Tensor) -> float:
    """ShortGPT's Block Importance of a layer: 1 - the mean over tokens of cos(input, output)
    of its hidden states [..., hidden]. A layer that changes nothing scores 0."""
    x = inputs.reshape(-1, inputs.shape[-1]).double()
    y = outputs.reshape(-1, outputs.shape[-1]).double()
    return float(1.0 - torch.nn.functional.cosine_similarity(x, y, dim=-1).mean())


def kept_indices(scores: Tensor, keep: int) -> Tensor:
    """Indices to keep, in their original order: the `keep` highest scores (ties: the lower
    index first)."""
    if not 0 < keep <= scores.numel():
        raise ValueError(f"keep {keep} of {scores.numel()}")
    order = torch.argsort(scores, descending=True, stable=True)
    return order[:keep].sort().values
