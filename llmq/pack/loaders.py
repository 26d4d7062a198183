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
from typing import Any

from llmq.config import QuantArgs
from llmq.errors import InputError
from llmq.pack.format import DECOMPRESSED_TO_BFLOAT16, PackFormat

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


def loader_support(weights: QuantArgs | None, fmt: PackFormat) -> list[LoaderSupport]:
    """Per loader, whether it reads a checkpoint of these weight arguments and format (None,
    DENSE: pruned alone, a plain checkpoint with no quantized linear for llmq's kernels)."""
    if weights is None:
        plain = "a plain checkpoint (pruned, not quantized): no quantized linear to run"
        return [LoaderSupport("transformers", True), LoaderSupport("vllm", True),
                LoaderSupport("llmq", False, plain)]  # fmt: skip
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


def check_required_loaders(
    weights: QuantArgs | None, fmt: PackFormat, required: tuple[str, ...] | list[str]
) -> dict[str, dict[str, Any]]:
    """Per loader, whether it reads this format (what `llmq.json` records); InputError when a
    `required` one cannot, before any work."""
    support = loader_support(weights, fmt)
    for name in required:
        if name not in LOADERS:
            raise InputError(f"--require-loader {name!r}: not a loader", hint=f"choose from: {', '.join(LOADERS)}")  # fmt: skip
        why = next((s.why for s in support if s.loader == name and not s.reads), None)
        if why is not None:
            label = "dense" if weights is None else weights.label
            raise InputError(
                f"--require-loader {name}: {name} cannot load {label} weights ({why})",
                hint="use a symmetric scheme (w4a16, w8a16), which every loader reads",
            )
    return {s.loader: {"reads": s.reads, "why": s.why} for s in support}


def mixed_formats_support(formats: set[PackFormat]) -> LoaderSupport | None:
    """transformers' verdict on a checkpoint whose config groups are written in `formats`
    (a budget's mix), when the mix keeps it from reading them: with an FP4 or MX group beside
    groups of another format, its `dequantize=True` load applies one config group to every
    dense module and its compressed load decompresses FP4 only into bfloat16 models (found by
    `llmq verify`; compressed-tensors and llmq read each group in its own format)."""
    if len(formats) < 2 or not formats & set(DECOMPRESSED_TO_BFLOAT16):
        return None
    why = (
        "FP4 and MX groups beside groups of other formats are read by neither of its loads "
        f"(transformers {installed_version('transformers') or 'not installed'})"
    )
    return LoaderSupport("transformers", False, why)
