"""TF32 matrix products on CUDA devices, for the calibrated layer loop."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def tensor_float32(enabled: bool) -> Iterator[None]:
    """Float32 matrix products and convolutions on CUDA devices in TF32 while the context is
    open (`enabled`), else in true float32; the CPU is unaffected.

    TF32 rounds the inputs of a product to 10 bits of mantissa and accumulates in float32:
    on an H200 it halved a Llama-3-8B-shaped GPTQ layer's time (6.95 -> 3.51 s,
    benchmarks/RESULTS.md). Its relative error (~5e-4 a product) is a sixteenth of the
    bfloat16 the peers calibrate in, and GPTQ's Hessians are sums over many tokens, damped by
    1% of their mean diagonal before they are inverted."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    previous = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = previous
