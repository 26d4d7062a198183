"""Cutting a layer's tensors down to what a plan keeps: rows and columns of the linears, entries
of the norms, by the roles the family layout gives them (llmq.io.family.StructuredRoles)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmq.io.layout import DecoderLayout, StructuredRoles


def slice_layer(
    tensors: dict[str, Tensor],
    roles: StructuredRoles,
    channels: Tensor,
    kv_groups: Tensor,
    query_heads: Tensor,
    config: dict[str, Any],
    hidden: Tensor | None = None,
) -> dict[str, Tensor]:
    """A layer's tensors (names relative to the layer) with only the kept MLP channels,
    key-value groups (each with its query heads) and hidden channels; anything else as it was."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rows = {
        roles.query: _head_rows(query_heads, head_dim),
        **{name: _head_rows(kv_groups, head_dim) for name in roles.key_value},
        **dict.fromkeys(roles.mlp_input, channels),
    }
    columns = {
        roles.attention_output: _head_rows(query_heads, head_dim),
        roles.mlp_output: channels,
    }
    sliced = {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        if module in rows:  # weight [out, in] or bias [out]
            tensor = tensor.index_select(0, rows[module])
        elif module in columns and kind == "weight":
            tensor = tensor.index_select(1, columns[module])
        sliced[name] = tensor
    if hidden is not None:
        sliced = _hidden_sliced(sliced, roles, hidden)
    return {name: tensor.contiguous() for name, tensor in sliced.items()}


def _hidden_sliced(
    tensors: dict[str, Tensor], roles: StructuredRoles, hidden: Tensor
) -> dict[str, Tensor]:
    """Only the kept hidden channels: columns of what reads the residual stream, rows (and
    biases) of what writes it, entries of the norms in front of the readers."""
    sliced = {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        if module in roles.hidden_readers and kind == "weight":
            tensor = tensor.index_select(1, hidden)
        elif module in roles.hidden_writers or module in roles.norms:
            tensor = tensor.index_select(0, hidden)
        sliced[name] = tensor
    return sliced


def slice_outer(
    tensors: dict[str, Tensor], hidden: Tensor | None, layout: DecoderLayout
) -> dict[str, Tensor]:
    """The tensors outside the decoder layers with only the kept hidden channels: the
    embedding's and lm_head's columns, the final norm's entries."""
    if hidden is None:
        return tensors
    by_hidden = {f"{layout.embed}.weight": 1, f"{layout.lm_head}.weight": 1, f"{layout.final_norm}.weight": 0}  # fmt: skip
    sliced = dict(tensors)
    for name, dim in by_hidden.items():
        if name in sliced:  # lm_head is absent when tied to the embedding
            sliced[name] = sliced[name].index_select(dim, hidden).contiguous()
    return sliced


def _head_rows(heads: Tensor, head_dim: int) -> Tensor:
    return (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()
