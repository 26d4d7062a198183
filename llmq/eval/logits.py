"""Reference log-probabilities: what a checkpoint's own files compute on a few fixed prompts.

`llmq quantize` records them in `llmq.json`, computed by llmq's evaluator (one layer at a time,
weights dequantized and activations quantized exactly as the format says) from the files it
has just written, with a SHA-256 of each file. `llmq verify` loads the checkpoint with each
loader, runs the same token ids and compares: a loader that reads the files wrongly, or files
that changed after writing, show up with no original model at hand.

Per prompt position the record keeps the TOP_K most likely next tokens and their
log-probabilities; a loader is compared on exactly those tokens (log-probabilities, not logits,
so loaders that only report log-probabilities, like vLLM, compare the same way).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmq.calib.tokenizer import load_tokenizer
from llmq.errors import InputError
from llmq.eval.ppl import describe_quantization, run_checkpoint
from llmq.io.checkpoint import INDEX_FILE, Checkpoint, read_index
from llmq.io.record import OutputRecord
from llmq.pack.reader import QuantizedView

VERIFY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "To be, or not to be, that is the question:",
)
TOP_K = 8
# Largest |difference| in log-probability over the recorded tokens still counted as the same
# weights. Loaders that compute in float32 in another order agree to about 1e-5 on the default
# model's weight-only checkpoints; one group scale of one linear doubled moves it by 0.08.
LOGPROB_TOLERANCE = 0.02


@dataclass(frozen=True, slots=True)
class PromptReference:
    input_ids: list[int]
    top_ids: list[list[int]]  # [position][TOP_K], most likely first
    top_logprobs: list[list[float]]  # [position][TOP_K]


@dataclass(frozen=True, slots=True)
class Reference:
    """What the files compute on VERIFY_PROMPTS. `prompts`: as the format runs (activations and
    KV cache quantized where it says). `weights_only`: the same weights with activations and KV
    cache in float, for schemes that quantize them (None for weight-only schemes, where it is
    `prompts`). `activation_effect`: the largest |Δ log-prob| between the two.

    Why both: quantizing activations rounds at run time, and two correct loaders that order
    their float32 arithmetic differently flip some codes (an FP8 code step is 6-12% of the
    value), so on the default model's FP8 and W8A8 checkpoints their log-probabilities differ by
    up to the activation quantization's own effect (1.4-2.2). A loader that can run the
    weights alone is held to LOGPROB_TOLERANCE on `weights_only`; one that must quantize
    activations (llmq's and vLLM's kernels) to LOGPROB_TOLERANCE + 2 x activation_effect
    (`llmq.eval.verify.ACTIVATION_EFFECT_FACTOR`)."""

    computed_by: str
    prompts: list[PromptReference]
    weights_only: list[PromptReference] | None = None
    activation_effect: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reference:
        weights = data.get("weights_only")
        return cls(
            data["computed_by"],
            [PromptReference(**p) for p in data["prompts"]],
            None if weights is None else [PromptReference(**p) for p in weights],
            float(data.get("activation_effect", 0.0)),
        )

    @property
    def input_ids(self) -> list[list[int]]:
        return [p.input_ids for p in self.prompts]

    def weights(self) -> list[PromptReference]:
        """The reference of the weights alone (activations and KV cache in float)."""
        return self.prompts if self.weights_only is None else self.weights_only


@dataclass(frozen=True, slots=True)
class Distance:
    """How far a loader's log-probabilities are from a reference's, on the reference's top
    tokens: the largest and mean |difference|, and at how many positions the reference's most
    likely token is also the loader's most likely among those tokens."""

    max_abs: float
    mean_abs: float
    top1_agreement: float


def prompt_ids(folder: Path) -> list[list[int]]:
    """The token ids of VERIFY_PROMPTS, with BOS when the tokenizer starts sequences with it."""
    tokenizer = load_tokenizer(folder)
    bos = [int(tokenizer.bos_token_id)] if tokenizer.add_bos else []
    return [bos + tokenizer.encode(prompt) for prompt in VERIFY_PROMPTS]


def padded(ids: list[list[int]]) -> Tensor:
    """Prompts as one batch [prompts, longest], right-padded: attention is causal, so padding
    after a prompt cannot change its positions."""
    batch = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.int64)
    for row, prompt in enumerate(ids):
        batch[row, : len(prompt)] = torch.tensor(prompt)
    return batch


def unpadded(log_probs: Tensor, ids: list[list[int]]) -> list[Tensor]:
    """Per prompt, its own positions of a padded batch's [prompts, longest, vocab]."""
    return [log_probs[row, : len(prompt)] for row, prompt in enumerate(ids)]


def top_tokens(log_probs: list[Tensor], ids: list[list[int]]) -> list[PromptReference]:
    prompts = []
    for prompt, values in zip(ids, log_probs, strict=True):
        top = values.topk(TOP_K, dim=-1)
        prompts.append(PromptReference(prompt, top.indices.tolist(), top.values.tolist()))
    return prompts


def distance(reference: list[PromptReference], log_probs: list[Tensor]) -> Distance:
    """Compare full log-probabilities [positions, vocab] per prompt with a reference."""
    gathered = []
    for prompt, values in zip(reference, log_probs, strict=True):
        ids = torch.tensor(prompt.top_ids)
        gathered.append(values.float().cpu().gather(-1, ids))
    return distance_on_top(reference, gathered)


def distance_on_top(reference: list[PromptReference], values: list[Tensor]) -> Distance:
    """Compare log-probabilities of a reference's top tokens [positions, TOP_K] per prompt."""
    diffs, agree, positions = [], 0, 0
    for prompt, got in zip(reference, values, strict=True):
        expected = torch.tensor(prompt.top_logprobs)
        diffs.append((got - expected).abs().flatten())
        agree += int((got.argmax(dim=-1) == 0).sum())
        positions += got.shape[0]
    every = torch.cat(diffs)
    if not torch.isfinite(every).all():
        return Distance(float("inf"), float("inf"), agree / positions)
    return Distance(float(every.max()), float(every.mean()), agree / positions)


def file_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of each file a loader reads: the shards the index lists, config and index."""
    index = folder / INDEX_FILE
    shards = read_index(index).values() if index.is_file() else [p.name for p in folder.glob("*.safetensors")]  # fmt: skip
    names = sorted(
        name for name in {"config.json", INDEX_FILE, *shards} if (folder / name).is_file()
    )
    # hashlib releases the GIL on big buffers: one thread a core hashes files side by side
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:
        return dict(zip(names, pool.map(_sha256, [folder / name for name in names]), strict=True))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def changed_files(folder: Path, recorded: dict[str, str]) -> list[str]:
    """Files whose content differs from the record (or that are missing or new)."""
    now = file_hashes(folder)
    return sorted(name for name in set(now) | set(recorded) if now.get(name) != recorded.get(name))


def recorded_reference(record: OutputRecord, where: Path) -> Reference | None:
    raw = record.reference
    if raw is None:
        return None
    try:
        return Reference.from_dict(raw)
    except (KeyError, TypeError) as exc:
        raise InputError(f"{where}: the recorded reference is damaged ({exc})") from None


def evaluator_log_probs(
    ckpt: Checkpoint,
    ids: list[list[int]],
    *,
    device: str | None = None,
    simulate_activations: bool = True,
) -> list[Tensor]:
    """Log-probabilities [positions, vocab] per prompt, as llmq's evaluator computes them."""
    stream, hidden = run_checkpoint(
        ckpt, QuantizedView(ckpt), padded(ids), device=device,
        simulate_activations=simulate_activations,
    )  # fmt: skip
    return unpadded(stream.log_probs(hidden), ids)


def quantizes_activations(view: QuantizedView) -> bool:
    return view.kv_cache is not None or any(s.input_activations for _, s in view.groups)


def compute_reference(ckpt: Checkpoint, *, device: str | None = None) -> Reference:
    """The reference of a checkpoint's files, from llmq's evaluator (float32)."""
    ids = prompt_ids(ckpt.path)
    view = QuantizedView(ckpt)
    as_run = evaluator_log_probs(ckpt, ids, device=device)
    computed_by = f"llmq evaluator, float32 ({describe_quantization(view)})"
    if not quantizes_activations(view):
        return Reference(computed_by, top_tokens(as_run, ids))
    prompts = top_tokens(as_run, ids)
    weights = evaluator_log_probs(ckpt, ids, device=device, simulate_activations=False)
    effect = distance(prompts, weights).max_abs
    return Reference(computed_by, prompts, top_tokens(weights, ids), effect)
