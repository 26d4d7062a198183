"""How important each unit is: one calibration pass over the dense model (`score_model`) and,
for `--depth-metric ppl`, the perplexity cost of dropping each layer (`depth_by_perplexity`);
the scores saved so that several targets reuse one pass (`Importance`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from llmq.calib.collect import collect_stats
from llmq.calib.stream import LayerStream
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress
from llmq.pruning.importance import (
    block_importance,
    channel_importance,
    head_importance,
    hidden_importance,
    kv_group_importance,
)
from llmq.pruning.structured.plan import kv_heads, structured_roles

IMPORTANCE_FORMAT = "llmq-importance/2"  # 2: with hidden channels


@dataclass(slots=True)
class Importance:
    """What the scoring pass measured, per decoder layer (saved so that several targets reuse
    one pass)."""

    channels: list[Tensor]  # [intermediate] per layer
    kv_groups: list[Tensor]  # [num_kv_heads] per layer
    heads: list[Tensor]  # [num_attention_heads] per layer
    blocks: Tensor  # [layers] Block Importance
    hidden: Tensor  # [hidden_size], over the whole model

    def save(self, path: Path) -> None:
        from llmq.io.atomic import save_safetensors

        tensors = {"blocks": self.blocks.contiguous(), "hidden": self.hidden.contiguous()}
        for index, (channels, groups, heads) in enumerate(
            zip(self.channels, self.kv_groups, self.heads, strict=True)
        ):
            tensors[f"layers.{index}.channels"] = channels.contiguous()
            tensors[f"layers.{index}.kv_groups"] = groups.contiguous()
            tensors[f"layers.{index}.heads"] = heads.contiguous()
        save_safetensors(path, tensors, {"format": IMPORTANCE_FORMAT})

    @classmethod
    def load(cls, path: Path) -> Importance:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(path)
            layers = len(tensors["blocks"])
            return cls(
                [tensors[f"layers.{i}.channels"] for i in range(layers)],
                [tensors[f"layers.{i}.kv_groups"] for i in range(layers)],
                [tensors[f"layers.{i}.heads"] for i in range(layers)],
                tensors["blocks"],
                tensors["hidden"],
            )
        except (OSError, KeyError, SafetensorError) as exc:
            raise InputError(f"{path}: not an importance file ({exc})") from None


def score_structured(
    ckpt: Checkpoint,
    input_ids: Tensor,
    *,
    depth_metric: Literal["block", "ppl"] = "block",
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Importance:
    """Every unit's importance on the calibration windows, the layers ranked by Block
    Importance ("block") or by the perplexity increase from dropping each alone ("ppl")."""
    with progress.stage("scoring heads, channels and layers"):
        scores = score_model(ckpt, input_ids, progress=progress, device=device)
    if depth_metric == "ppl":
        scores.blocks = depth_by_perplexity(ckpt, input_ids, progress=progress, device=device)
    return scores


def score_model(
    ckpt: Checkpoint,
    input_ids: Tensor,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Importance:
    """One pass over the dense model on the calibration windows."""
    roles = structured_roles(ckpt)
    heads, groups_n = ckpt.config["num_attention_heads"], kv_heads(ckpt.config)
    blocks: list[float] = []
    stats = collect_stats(
        ckpt, input_ids, norms=True, progress=progress, device=device,
        on_layer=lambda _index, before, after: blocks.append(block_importance(before, after)),
    )  # fmt: skip
    channels, groups, head_scores, norm_outputs = [], [], [], []
    for index in range(ckpt.num_layers):
        prefix = ckpt.layout.layer_prefix(index)
        mlp_output = stats.inputs[prefix + roles.mlp_output].sq_sum
        attention_output = stats.inputs[prefix + roles.attention_output].sq_sum
        assert mlp_output is not None and attention_output is not None
        channels.append(channel_importance(mlp_output))
        head_scores.append(head_importance(attention_output, heads))
        groups.append(kv_group_importance(head_scores[-1], groups_n))
        for reader in roles.norm_readers:  # the outputs of the norms
            sq_sum = stats.inputs[prefix + reader].sq_sum
            assert sq_sum is not None
            norm_outputs.append(sq_sum)
    blocks_t = torch.tensor(blocks, dtype=torch.float64)
    return Importance(channels, groups, head_scores, blocks_t, hidden_importance(norm_outputs))


DEPTH_METRIC_WINDOWS = 16
"""Calibration windows the `ppl` depth metric runs on: it holds one copy of their hidden states
per layer (the default model: 31 x 19 MB), so it reads the first 16, not all of them."""


def depth_by_perplexity(
    ckpt: Checkpoint,
    input_ids: Tensor,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Tensor:
    """[layers] the relative perplexity increase from dropping each layer alone (the layer's
    output replaced by its input), on the first DEPTH_METRIC_WINDOWS windows.

    One pass over the layers, each loaded once: branch i (the model without layer i) forks
    from the full model's hidden states just before layer i and skips it; every other layer
    runs on every branch that exists by then, about layers² / 2 layer passes in all."""
    ids = input_ids[:DEPTH_METRIC_WINDOWS]
    stream = LayerStream(ckpt, device=device)
    dropped: list[Tensor] = []
    walk = stream.walk(stream.embed(ids), progress=progress, label="dropping each layer in turn")
    with torch.inference_mode():
        for layer in walk:
            full = layer.hidden
            branches = [*dropped, full]
            dropped.append(full.clone())
            for hidden in branches:
                stream.run_layer(layer.module, hidden, in_place=True)
            layer.advance(full)
    base, count = stream.token_nll(walk.hidden, ids)
    scores = [math.exp((stream.token_nll(hidden, ids)[0] - base) / count) - 1.0 for hidden in dropped]  # fmt: skip
    return torch.tensor(scores, dtype=torch.float64)
