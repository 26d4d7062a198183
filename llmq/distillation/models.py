"""Teacher and student as transformers models in memory, and the trained student written back
as a checkpoint shaped like the one it came from."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from llmq.calib.tokenizer import load_tokenizer
from llmq.errors import InputError
from llmq.io.atomic import save_safetensors
from llmq.io.checkpoint import Checkpoint, torch_dtype
from llmq.io.record import OutputRecord

_SAME_TOKENIZER = (
    "distillation compares token distributions: use a student with the teacher's tokenizer"
)


def check_trainable(ckpt: Checkpoint, role: str) -> None:
    """A float checkpoint transformers loads as stored (not an FP8 release, which llmq reads
    as bfloat16 one layer at a time, and transformers would load as its FP8 codes)."""
    if ckpt.quantization_config or ckpt.views:
        raise InputError(
            f"{ckpt.path}: the {role} is quantized",
            hint="distill float checkpoints; quantize the student afterwards (`llmq quantize`)",
        )


def check_same_vocabulary(teacher: Checkpoint, student: Checkpoint) -> None:
    """Distillation compares the two models' distributions over the same token ids: the
    vocabulary sizes (logit widths) and the tokens behind each id must agree."""
    sizes = teacher.config.get("vocab_size"), student.config.get("vocab_size")
    if sizes[0] != sizes[1]:
        raise InputError(
            f"the student's vocab_size {sizes[1]} differs from the teacher's {sizes[0]}",
            hint=_SAME_TOKENIZER,
        )
    if load_tokenizer(teacher.path).vocabulary() != load_tokenizer(student.path).vocabulary():
        raise InputError(
            f"the student's tokenizer ({student.path}) has other tokens than the teacher's",
            hint=_SAME_TOKENIZER,
        )


def load_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The whole model in memory (training needs every layer at once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype)
    return model.to(device)


def kept_layers(ckpt: Checkpoint, teacher_layers: int) -> list[int] | None:
    """The teacher layers a depth-pruned student kept, from `llmq prune --structured`'s record;
    None when there is no such record or it was pruned from a model of another depth."""
    try:
        removed = set(OutputRecord.read(ckpt.path).structured["removed"]["layers"])  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    source_layers = ckpt.num_layers + len(removed)
    if source_layers != teacher_layers:
        return None
    return [i for i in range(source_layers) if i not in removed]


def write_student(
    state: Mapping[str, Tensor],
    source: Checkpoint,
    staging: Path,
    record: OutputRecord,
    device: str | None,
    *,
    reference: bool,
) -> None:
    """The student's weights (`state`: its state dict) under the source checkpoint's names and
    dtypes (a tied lm_head stays tied), one shard per decoder layer as every llmq output, then
    config, tokenizer and llmq.json."""
    from llmq.pipeline.output import ShardNames, finish_checkpoint

    shards = ShardNames.per_layer(source.num_layers)
    layers = source.layout.layers + "."
    groups: list[list[str]] = [[] for _ in range(shards.total)]
    for name in source.tensors:
        index = 0 if not name.startswith(layers) else int(name[len(layers) :].split(".")[0]) + 1
        groups[index].append(name)
    for shard, names in enumerate(groups):
        tensors = {
            n: state[n].detach().to("cpu", torch_dtype(source.tensors[n].dtype)) for n in names
        }
        save_safetensors(staging / shards.name(shard), tensors)
    finish_checkpoint(
        source.path, staging, shards, dict(source.config), record, device, reference=reference
    )
