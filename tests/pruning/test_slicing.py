"""Slicing a layer to a plan goes by the family layout's structured roles; a family without
roles is refused before any work."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import llmq
from llmq.errors import InputError
from llmq.io import family
from llmq.io.family import FAMILY_LAYOUT
from llmq.io.layout import StructuredRoles
from llmq.pruning.structured import slice_layer

CONFIG = {"hidden_size": 8, "num_attention_heads": 4, "head_dim": 2}


def test_each_role_loses_its_axis_and_nothing_else() -> None:
    """Query heads 1 and 3 (rows 2-3 and 6-7 of q, columns of o), key-value group 1 (rows 2-3
    of k and v), MLP channels 0 and 2 (rows of gate/up, columns of down), hidden channels 0-3
    (columns of the readers, rows of the writers, entries of the norms)."""
    roles = FAMILY_LAYOUT["llama"].structured
    assert roles is not None
    shapes = {
        "self_attn.q_proj.weight": (8, 8), "self_attn.k_proj.weight": (4, 8),
        "self_attn.v_proj.weight": (4, 8), "self_attn.k_proj.bias": (4,),
        "self_attn.o_proj.weight": (8, 8), "mlp.gate_proj.weight": (4, 8),
        "mlp.up_proj.weight": (4, 8), "mlp.down_proj.weight": (8, 4),
        "input_layernorm.weight": (8,), "post_attention_layernorm.weight": (8,),
    }  # fmt: skip
    tensors = {name: torch.arange(torch.Size(shape).numel()).reshape(shape).float() for name, shape in shapes.items()}  # fmt: skip
    heads, groups, channels, hidden = (
        torch.tensor([1, 3]), torch.tensor([1]), torch.tensor([0, 2]), torch.arange(4),
    )  # fmt: skip
    sliced = slice_layer(tensors, roles, channels, groups, heads, CONFIG, hidden)
    head_rows, group_rows = torch.tensor([2, 3, 6, 7]), torch.tensor([2, 3])
    expected = {
        "self_attn.q_proj.weight": tensors["self_attn.q_proj.weight"][head_rows][:, hidden],
        "self_attn.k_proj.weight": tensors["self_attn.k_proj.weight"][group_rows][:, hidden],
        "self_attn.v_proj.weight": tensors["self_attn.v_proj.weight"][group_rows][:, hidden],
        "self_attn.k_proj.bias": tensors["self_attn.k_proj.bias"][group_rows],
        "self_attn.o_proj.weight": tensors["self_attn.o_proj.weight"][hidden][:, head_rows],
        "mlp.gate_proj.weight": tensors["mlp.gate_proj.weight"][channels][:, hidden],
        "mlp.up_proj.weight": tensors["mlp.up_proj.weight"][channels][:, hidden],
        "mlp.down_proj.weight": tensors["mlp.down_proj.weight"][hidden][:, channels],
        "input_layernorm.weight": tensors["input_layernorm.weight"][hidden],
        "post_attention_layernorm.weight": tensors["post_attention_layernorm.weight"][hidden],
    }
    assert sliced.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(sliced[name], tensor), name


def test_the_roles_decide_what_is_sliced() -> None:
    """A module the roles do not name is left whole: the names come from the layout alone."""
    renamed = StructuredRoles(
        query="attn.wq", key_value=("attn.wkv",), attention_output="attn.wo",
        mlp_input=("ffn.w13",), mlp_output="ffn.w2", norms=("norm1", "norm2"),
    )  # fmt: skip
    tensors = {"ffn.w13.weight": torch.ones(4, 8), "mlp.up_proj.weight": torch.ones(4, 8)}
    sliced = slice_layer(tensors, renamed, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), CONFIG)  # fmt: skip
    assert sliced["ffn.w13.weight"].shape == (1, 8)
    assert sliced["mlp.up_proj.weight"].shape == (4, 8)


def test_a_family_without_structured_roles_is_refused_before_any_work(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(family.FAMILY_LAYOUT, "llama", replace(FAMILY_LAYOUT["llama"], structured=None))  # fmt: skip
    with pytest.raises(InputError, match="structured pruning cannot slice"):
        llmq.prune_structured(tiny_llama, tmp_path / "out", num_layers=1, evaluate=False)
    assert list(tmp_path.iterdir()) == []
