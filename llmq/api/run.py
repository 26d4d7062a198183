"""Running a checkpoint: `load_quantized`, `load_dequantized`, `generate`, `bench`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.api.common import (
    _open,
)
from llmq.config import (
    get_scheme,
)
from llmq.errors import InputError
from llmq.models import resolve_model
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:
    from torch import nn

    from llmq.runtime.bench import BenchReport


def load_dequantized(path: str | Path) -> nn.Module:
    """A transformers model with every quantized weight dequantized (float32), for comparison
    and inspection. Activations are not quantized by this model."""
    from llmq.runtime.load import load_dequantized as load

    return load(_open(path))


DTYPES = ("auto", "bfloat16", "float16", "float32")


def _dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise InputError(
            f"--dtype {name!r}: not a dtype", hint=f"choose one of: {', '.join(DTYPES)}"
        )
    return None if name == "auto" else getattr(torch, name)


def load_quantized(
    path: str | Path, *, device: str | None = None, dtype: str = "auto", kernels: str = "auto"
) -> nn.Module:
    """A transformers model whose quantized linears run llmq's kernels: Triton on a GPU, the torch
    reference of the same math on the CPU (kernels="triton" or "torch" forces one).
    dtype "auto": bfloat16 on a GPU, float32 on the CPU."""
    from llmq.runtime.load import load_quantized as load

    _check_kernels(kernels)
    return load(_open(path), device=device, dtype=_dtype(dtype), kernels=kernels)  # type: ignore[arg-type]


def _check_kernels(kernels: str) -> None:
    from llmq.runtime.load import KERNEL_CHOICES

    if kernels not in KERNEL_CHOICES:
        raise InputError(
            f"--kernels {kernels!r}: not a kernel choice",
            hint=f"choose one of: {', '.join(KERNEL_CHOICES)}",
        )


@dataclass(frozen=True, slots=True)
class GenerateResult:
    model: str
    prompt: str
    text: str  # the continuation only
    new_tokens: int
    prefill_seconds: float
    decode_tokens_per_second: float
    device: str
    kernels: str  # "triton" or "torch"


def generate(
    path: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 32,
    device: str | None = None,
    dtype: str = "auto",
    kernels: str = "auto",
) -> GenerateResult:
    """Greedy continuation of `prompt` by a quantized checkpoint running on llmq's kernels."""
    from transformers import AutoTokenizer

    from llmq.runtime.generate import greedy_decode
    from llmq.runtime.load import kernels_in_use

    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if not prompt:
        raise InputError("--prompt is empty")
    folder = resolve_model(path)
    model = load_quantized(folder, device=device, dtype=dtype, kernels=kernels)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    run = greedy_decode(
        model, input_ids, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id
    )
    return GenerateResult(
        model=str(folder),
        prompt=prompt,
        text=tokenizer.decode(run.tokens, skip_special_tokens=True),
        new_tokens=len(run.tokens),
        prefill_seconds=run.prefill_seconds,
        decode_tokens_per_second=run.decode_tokens_per_second,
        device=str(next(model.parameters()).device),
        kernels=kernels_in_use(model),
    )


def bench(
    path: str | Path | None = None,
    *,
    shapes: list[str] | None = None,
    scheme: str = "w4a16",
    batch_sizes: list[int] | None = None,
    prompt_tokens: int | None = None,
    new_tokens: int | None = None,
    device: str | None = None,
    dtype: str = "auto",
    kernels: str = "auto",
    progress: Progress = NO_PROGRESS,
) -> BenchReport:
    """Time a quantized checkpoint's layer shapes and its prefill/decode against the same weights
    dequantized to 16 bits (float32 on the CPU), in one run; or, with `shapes` ("MxNxK") and no
    path, synthetic layers of `scheme`. Returns a `llmq.runtime.bench.BenchReport`."""
    from llmq.calib.stream import resolve_device
    from llmq.runtime import bench as runtime_bench
    from llmq.runtime.load import default_dtype, kernels_in_use, use_triton
    from llmq.runtime.load import load_dequantized as load_dense

    if (path is None) == (not shapes):
        raise InputError(
            "give either a checkpoint or --shapes",
            hint="llmq bench OUT, or llmq bench --shapes 1x4096x4096",
        )
    _check_kernels(kernels)
    if prompt_tokens is not None and prompt_tokens < 1:
        raise InputError(f"--prompt-tokens {prompt_tokens}: must be at least 1")
    if new_tokens is not None and new_tokens < 2:
        raise InputError(f"--new-tokens {new_tokens}: must be at least 2 (one to time decode)")
    if path is None:
        parsed = [runtime_bench.Shape.parse(text) for text in shapes or []]
        resolved = resolve_device(device)
        compute = _dtype(dtype) or default_dtype(resolved)
        return runtime_bench.bench_shapes(
            parsed, get_scheme(scheme), device=resolved, dtype=compute,
            triton=use_triton(kernels, resolved), progress=progress,
        )  # fmt: skip
    started = time.perf_counter()
    model = load_quantized(path, device=device, dtype=dtype, kernels=kernels)
    load_seconds = time.perf_counter() - started
    first = next(model.parameters())
    gpu = first.is_cuda
    batch_sizes = batch_sizes or ([1, 16, 256] if gpu else [1, 16])
    if min(batch_sizes) < 1:
        raise InputError(f"--batch-size {batch_sizes}: every batch size must be at least 1")
    dense = load_dense(_open(path)).to(device=first.device, dtype=first.dtype)
    report = runtime_bench.bench_model(
        model, dense, batch_sizes=batch_sizes,
        prompt_tokens=prompt_tokens or (256 if gpu else 32),
        new_tokens=new_tokens or (64 if gpu else 8),
        dtype=first.dtype, triton=kernels_in_use(model) == "triton", progress=progress,
    )  # fmt: skip
    report.load_seconds = load_seconds
    return report
