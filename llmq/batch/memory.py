"""A job's peak memory, estimated before it runs from the model's tensor sizes and the recipe's
stages: what `llmq batch` admits jobs by (`--max-memory`), and what Ray reserves per task.

The layer pipeline (quantize, one-shot prune) holds one decoder layer at a time in float32,
several copies of it in flight (the layer, its quantized twin, GPTQ's Hessians and the next
layer prefetched), the embedding and head, and the calibration activations. Distillation holds
the teacher and the student with gradients and AdamW's two moments; structured pruning and
evaluation hold whole models. A fixed allowance covers the interpreter, torch and transformers.
Estimates err high: a job admitted must not be the one that runs the machine out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmq.io.checkpoint import Checkpoint
from llmq.recipes.schema import ChainRecipe

RUNTIME_BYTES = 1 << 30  # Python, torch and transformers loaded, before any tensor
LAYER_COPIES = 4  # a layer in float32 in flight: weights, quantized copy, statistics, prefetch
ACTIVATION_COPIES = 3  # calibration activations: inputs, outputs, the float reference
TRAINING_COPIES = 4  # the student's weights, gradients and AdamW's two moments


@dataclass(frozen=True, slots=True)
class ModelSizes:
    """float32 bytes of a checkpoint's parts."""

    total: int  # every tensor
    outside_layers: int  # embedding, head, final norm
    largest_layer: int  # the largest decoder layer
    hidden_size: int

    @classmethod
    def of(cls, ckpt: Checkpoint) -> ModelSizes:
        layers: dict[int, int] = {}
        total = 0
        prefix = f"{ckpt.layout.layers}."
        for name, info in ckpt.tensors.items():
            elements = 1
            for dim in info.shape:
                elements *= dim
            total += 4 * elements
            if name.startswith(prefix):
                index = int(name[len(prefix) :].split(".", 1)[0])
                layers[index] = layers.get(index, 0) + 4 * elements
        largest = max(layers.values(), default=0)
        hidden = int(ckpt.config["hidden_size"])
        return cls(total, total - sum(layers.values()), largest, hidden)


def stage_peak(kind: str, stage: object, sizes: ModelSizes) -> int:
    """Peak bytes of one stage, beyond the runtime allowance."""
    if kind in ("quantize", "prune") and not getattr(stage, "structured", False):
        windows = (getattr(stage, "num_samples", None) or 128) * getattr(stage, "seq_len", 512)
        activations = ACTIVATION_COPIES * windows * sizes.hidden_size * 4
        return sizes.outside_layers + LAYER_COPIES * sizes.largest_layer + activations
    if kind == "distill":  # the teacher, and the student with gradients and moments
        return sizes.total + TRAINING_COPIES * sizes.total
    return 2 * sizes.total  # structured pruning, evaluation: a model and its reference


def job_peak(recipe: ChainRecipe, sizes: ModelSizes) -> int:
    """Bytes a job needs at its peak: the largest stage's, plus the runtime allowance."""
    peaks = [stage_peak(entry.kind, entry.stage, sizes) for entry in recipe.stages]
    return RUNTIME_BYTES + max(peaks, default=0)
