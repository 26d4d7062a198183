"""The checkpoint a run writes: one shard per decoder layer plus one for everything else,
then the index, config, side files and llmq's record."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from llmq.config import Recipe
from llmq.io.atomic import write_json, write_record
from llmq.io.checkpoint import Checkpoint, side_files, torch_dtype
from llmq.io.fused_experts import mxfp4_release_config
from llmq.io.record import OutputRecord
from llmq.pack.format import PackFormat, quantization_config, scheme_format
from llmq.pipeline.plan import LinearPlan, Plan, config_groups
from llmq.pipeline.state import remove_resume_points


def other_layer_tensors(
    ckpt: Checkpoint, layer: nn.Module, prefix: str, local: dict[str, LinearPlan]
) -> dict[str, Tensor]:
    """Tensors of the layer that are not quantized weights (norms, biases, ignored linears), in
    their stored dtype, from the module: AWQ may have folded scales into them."""
    quantized = {f"{prefix}{name}.weight" for name in local}
    state = layer.state_dict()
    return {
        name: state[name[len(prefix) :]].to(
            device="cpu", dtype=torch_dtype(ckpt.tensors[name].dtype)
        )
        for name in ckpt.names_with_prefix(prefix)
        if name not in quantized
    }


def non_layer_tensors(ckpt: Checkpoint) -> dict[str, Tensor]:
    layers = ckpt.layout.layers + "."
    return {name: ckpt.read(name) for name in ckpt.tensors if not name.startswith(layers)}


class ShardNames:
    """The names of a checkpoint's `total` shards. The layer pipeline writes one shard per
    decoder layer plus one (`per_layer`): shard 0 holds embeddings, final norm and lm_head,
    shard i + 1 decoder layer i."""

    def __init__(self, total: int) -> None:
        self.total = total

    @classmethod
    def per_layer(cls, num_layers: int) -> ShardNames:
        return cls(num_layers + 1)

    def name(self, shard: int) -> str:
        return f"model-{shard + 1:05d}-of-{self.total:05d}.safetensors"


def finalize(
    ckpt: Checkpoint,
    plan: Plan,
    recipe: Recipe,
    staging: Path,
    shards: ShardNames,
    record: OutputRecord,
    device: str | None,
    *,
    reference: bool = True,
) -> None:
    """Index, config (with its quantization_config), side files and llmq's record of a
    quantization (or pruning) run."""
    config = dict(ckpt.config)
    fmt = scheme_format(recipe.scheme)
    if ckpt.layout.experts is not None and ckpt.layout.experts.stored_fused:
        if fmt is PackFormat.MXFP4_PACK_QUANTIZED:  # GPT-OSS's own MXFP4 experts
            config["quantization_config"] = mxfp4_release_config(ckpt.layout)
    elif fmt is not PackFormat.DENSE:  # pruned alone: a plain checkpoint every loader reads
        config["quantization_config"] = quantization_config(
            config_groups(plan), ignore=plan.ignored, fmt=fmt, kv_cache=recipe.kv_cache_args
        )
    finish_checkpoint(ckpt.path, staging, shards, config, record, device, reference=reference)


def finish_checkpoint(
    source: Path,
    staging: Path,
    shards: ShardNames,
    config: dict[str, Any],
    record: OutputRecord,
    device: str | None,
    *,
    reference: bool = True,
) -> None:
    """Everything of a written checkpoint but its shards: the index over them, `config`, the
    source's side files, and llmq.json (`record`, with the reference `llmq verify` checks and
    the files' hashes); the resume state goes."""
    from llmq.eval.logits import compute_reference, file_hashes
    from llmq.io.checkpoint import open_checkpoint, read_safetensors_header

    weight_map: dict[str, str] = {}
    total_size = 0
    for shard in range(shards.total):
        path = staging / shards.name(shard)
        for name in read_safetensors_header(path):
            weight_map[name] = path.name
        total_size += path.stat().st_size
    write_json(
        staging / "model.safetensors.index.json",
        {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
    )
    write_json(staging / "config.json", config)
    _copy_side_files(source, staging)
    # What the written files compute, and their hashes, for `llmq verify`.
    if reference:  # one more pass over the written layers (a few tokens each)
        record.reference = compute_reference(open_checkpoint(staging), device=device).to_dict()
    record.files = file_hashes(staging)
    write_record(staging, record)
    remove_resume_points(staging)


def _copy_side_files(source: Path, staging: Path) -> None:
    """Tokenizer, generation config, chat template, license...: everything but weights and config."""
    for path in side_files(source):
        shutil.copy2(path, staging / path.name)


def weights_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
