"""Which loaders read a checkpoint format, known before anything is written.

compressed-tensors packs an asymmetric int4/int8 checkpoint's zero points eight (or four) to an
int32 along the output dimension, and transformers' compressed-tensors loader expects them
unpacked: `from_pretrained` then fails with a size mismatch on `weight_zero_point` (for the
default model: checkpoint [72, 9], model [576, 9]). The upstream fix was merged and reverted
(llm-compressor #1618, #1704 open). vLLM and llmq read them. `llmq verify` is the ground truth:
it loads a written checkpoint with each installed loader and compares logits; its tests check
that this table still describes the installed versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from llmq.config import QuantArgs
from llmq.pack.format import PackFormat

LOADERS = ("transformers", "vllm", "llmq")


@dataclass(frozen=True, slots=True)
class LoaderSupport:
    loader: str
    reads: bool
    why: str | None = None  # why it does not


def installed_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def loader_support(weights: QuantArgs, fmt: PackFormat) -> list[LoaderSupport]:
    """Per loader, whether it reads a checkpoint of these weight arguments and format."""
    packed_zero_points = fmt is PackFormat.PACK_QUANTIZED and not weights.symmetric
    transformers = LoaderSupport("transformers", True)
    if packed_zero_points:
        versions = ", ".join(
            f"{name} {installed_version(name) or 'not installed'}"
            for name in ("transformers", "compressed-tensors")
        )
        transformers = LoaderSupport(
            "transformers",
            False,
            f"asymmetric {weights.label.split()[0]} zero points are stored packed and "
            f"transformers' loader expects them unpacked ({versions})",
        )
    return [transformers, LoaderSupport("vllm", True), LoaderSupport("llmq", True)]


def unreadable_by(weights: QuantArgs, fmt: PackFormat) -> dict[str, str]:
    """Loaders that cannot read such a checkpoint, and why."""
    return {s.loader: s.why or "" for s in loader_support(weights, fmt) if not s.reads}
