"""Exact statistics of one weight tensor: no sort, no sampling, no upcast copy.

Quartiles come from histograms of bit patterns. An 8- or 16-bit float has at most 65,536
distinct values, so one histogram of its bit patterns is the whole distribution
(`llmq.fallback.histogram`). A float32 is split in two: a histogram of its upper 16 bits finds
the bucket that holds a wanted rank, and a second pass collects the values of that bucket alone
(`llmq.fallback.float32`). The passes over the values are compiled (`llmq.fallback.passes`);
order statistics come from their counts (`llmq.fallback.quartiles`), quantization errors from
`quantize`'s own primitives (`llmq.fallback.quant_error`), and the result is a `TensorStats`
(`llmq.fallback.summary`).

This module is the entry point: it picks the path for each tensor, for one tensor
(`tensor_stats`) or a batch (`batch_stats`: the scan's, one file's tensors at a time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.fallback.float32 import (
    Float32Pass,
    float32_first_pass,
    float32_second_pass,
    float32_summary,
    int_grids,
)
from llmq.fallback.histogram import PATTERN_DTYPES, histogram_stats, small_float_stats
from llmq.fallback.summary import TensorStats

SUPPORTED_DTYPES = tuple(PATTERN_DTYPES)


def tensor_stats(
    weight: Tensor, args: QuantArgs | None, *, input_weights: Tensor | None = None
) -> TensorStats:
    """Exact statistics of `weight` (a CPU tensor of any shape and a dtype of SUPPORTED_DTYPES:
    the scan reads memory-mapped files, and part of the work runs in numpy) and, when `args`
    is given, its quantization error under `args` (rows: every dimension but the last).

    input_weights [in]: how much each input channel matters, e.g. E[x_j^2] on calibration data;
    gives `output_error` = sum_j ||dW_:j||^2 w_j, the diagonal approximation of the squared
    output error per token E||dW x||^2, and `weighted_nrmse` = sqrt(output_error /
    sum_j ||W_:j||^2 w_j), its approximation of ||dW X|| / ||W X||."""
    return batch_stats([weight], args, input_weights=[input_weights])[0]


def batch_stats(
    weights: Sequence[Tensor],
    args: QuantArgs | None,
    *,
    input_weights: Sequence[Tensor | None] | None = None,
) -> list[TensorStats]:
    """`tensor_stats` of each of `weights` (with its `input_weights`, if given). The float32
    tensors' per-tensor grids come from one `choose_qparams` call for all of them: called per
    tensor, its dozen small torch ops cost ~0.1 ms each time and hand the GIL to the other
    scan workers and back (a scan of the default model took 7-15% longer that way)."""
    if input_weights is None:
        input_weights = [None] * len(weights)
    results: dict[int, TensorStats] = {}
    pending: list[tuple[int, Float32Pass]] = []  # float32 tensors between their two passes
    for index, (weight, channel_weights) in enumerate(zip(weights, input_weights, strict=True)):
        if weight.dtype not in PATTERN_DTYPES:
            raise ValueError(f"unsupported dtype {weight.dtype}")
        channel_weights = _matching_input_weights(weight, channel_weights)
        if weight.element_size() <= 2:
            results[index] = small_float_stats(weight, args, channel_weights)
            continue
        summary = float32_summary(weight.reshape(-1))
        if summary.bfloat16_valued:  # a bf16 checkpoint saved as fp32: the histogram is exact
            results[index] = histogram_stats(
                weight, summary.upper, torch.bfloat16, args, channel_weights
            )
        else:
            pending.append((index, float32_first_pass(weight, summary, args, channel_weights)))
    grids = int_grids([first for _, first in pending], args)
    for (index, first), grid in zip(pending, grids, strict=True):
        results[index] = float32_second_pass(first, grid)
    return [results[index] for index in range(len(weights))]


def load_passes() -> None:
    """Load every compiled pass now: a process's first compiled call starts LLVM (~0.4 s), and
    each pass then loads from numba's disk cache (~10 ms). One tiny tensor of each path."""
    for dtype in (torch.float32, torch.bfloat16):
        tensor_stats(
            torch.linspace(-1.0, 1.0, 8).to(dtype), QuantArgs(num_bits=8, strategy="tensor")
        )


def _matching_input_weights(weight: Tensor, input_weights: Tensor | None) -> Tensor | None:
    """`input_weights`, or None when they are not this tensor's inputs (a 1-D tensor, another
    width)."""
    if input_weights is not None and (weight.ndim < 2 or input_weights.numel() != weight.shape[-1]):
        return None
    return input_weights
