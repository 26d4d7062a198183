"""Writing a structured-pruned checkpoint's shards, one decoder layer at a time: shard 0 holds
everything outside the decoder layers, shard i + 1 kept layer i, renumbered and sliced. The
index, config, side files and record are the shared writer's (llmq.pipeline.output)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmq.io.atomic import save_safetensors
from llmq.io.checkpoint import Checkpoint, torch_dtype
from llmq.progress import NO_PROGRESS, Progress
from llmq.pruning.structured.plan import StructuredPlan, kv_heads, structured_roles
from llmq.pruning.structured.slicing import slice_layer, slice_outer


def write_structured(
    ckpt: Checkpoint,
    plan: StructuredPlan,
    staging: Path,
    shard_name: Callable[[int], str],
    *,
    progress: Progress = NO_PROGRESS,
) -> None:
    """The shards of `ckpt` pruned as `plan` says, in a fresh `staging` folder; `shard_name(i)`:
    the file name of shard i (of len(plan.layers) + 1)."""
    roles = structured_roles(ckpt)
    layout = ckpt.layout
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    outer = {name: ckpt.read(name) for name in ckpt.tensors if not name.startswith(f"{layout.layers}.")}  # fmt: skip
    save_safetensors(staging / shard_name(0), slice_outer(outer, plan.hidden, layout))
    del outer
    with progress.stage("writing layers", total=len(plan.layers)) as advance:
        for new, (old, channels, groups, heads) in enumerate(
            zip(plan.layers, plan.channels, plan.kv_groups, plan.query_heads, strict=True)
        ):
            source, target = layout.layer_prefix(old), layout.layer_prefix(new)
            tensors = {n[len(source) :]: ckpt.read(n) for n in ckpt.names_with_prefix(source)}
            sliced = slice_layer(tensors, roles, channels, groups, heads, ckpt.config, plan.hidden)
            save_safetensors(
                staging / shard_name(new + 1), {target + n: t for n, t in sliced.items()}
            )
            advance(1)


def output_bytes(ckpt: Checkpoint, config: dict[str, Any]) -> int:
    """About the bytes the pruned checkpoint of `config` takes: what the space check reserves."""
    itemsize = max(torch_dtype(info.dtype).itemsize for info in ckpt.tensors.values())
    return parameter_count(config) * itemsize + 64 * 1024


def parameter_count(config: dict[str, Any]) -> int:
    """About the parameters of a Llama-style decoder of this config (embeddings and lm_head
    included, biases not)."""
    hidden, inter, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
    )
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads(config))
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden
