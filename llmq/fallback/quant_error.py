"""The quantization error of one tensor, computed by `quantize`'s own primitives
(`choose_qparams`, `quantize_grouped`, `scale_codes`, `quantize_weight`), so that the scan's
NRMSE is the error `quantize` would make.

A per-tensor error comes from the distinct values and their counts where a histogram lists them
(`value_error`); otherwise whole rows are quantized and restored in blocks of CHUNK_ELEMENTS
(`quantization_errors`), which, given input weights, also yields the weighted NRMSE and the
output error. The per-tensor integer error of a float32 tensor is summed by the compiled second
pass (`llmq.fallback.float32`) on the grid that `tensor_qparams` chooses here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from llmq.config import QuantArgs, fit_group_size
from llmq.fallback.summary import Moments, QuantErrors
from llmq.quant.primitives import (
    ACCUM_DTYPE,
    choose_qparams,
    quantize_grouped,
    quantize_weight,
    scale_codes,
)

CHUNK_ELEMENTS = 1 << 20
"""Elements processed at once: a few MB of working memory, whatever the tensor's size."""


def scale_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Scales are stored in the weight's dtype, as `quantize` writes them; float32 for FP8."""
    return dtype if dtype.itemsize >= 2 else ACCUM_DTYPE


def tensor_qparams(
    moments: Sequence[Moments], args: QuantArgs, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """Per-tensor scales and zero points (one each) of tensors of `dtype` with these `moments`,
    by `quantize`'s own `choose_qparams`, in one call."""
    return choose_qparams(
        torch.tensor([m.min for m in moments]), torch.tensor([m.max for m in moments]), args,
        scale_dtype=scale_dtype_for(dtype),
    )  # fmt: skip


def _view11(zero: Tensor | None) -> Tensor | None:
    return None if zero is None else zero.view(1, 1)


def value_error(
    values: Tensor, counts: Tensor, moments: Moments, args: QuantArgs, dtype: torch.dtype
) -> float:
    """Per-tensor quantization error from the distinct values: each value's error times its
    count. The codes come from the same primitives as `quantize`."""
    scale, zero = tensor_qparams([moments], args, dtype)
    codes = quantize_grouped(values.view(1, 1, -1), scale.view(1, 1), _view11(zero), args)
    restored = scale_codes(codes, scale, zero).to(torch.float64).view(-1)  # as quantize reads back
    return float(((values - restored).square() * counts).sum())


def quantization_errors(
    weight: Tensor,
    moments: Moments,
    args: QuantArgs | None,
    input_weights: Tensor | None,
    per_tensor_error: Callable[[], float] | None = None,
) -> QuantErrors:
    """(squared quantization error, weighted NRMSE, output error). A per-tensor error comes from
    the value histogram when it can (`per_tensor_error`); a 1-D tensor has no rows to scale per
    channel."""
    if args is None or (weight.ndim < 2 and args.strategy != "tensor"):
        return None, None, None
    if input_weights is None and args.strategy == "tensor" and per_tensor_error is not None:
        return per_tensor_error(), None, None
    return _blocked_errors(weight, moments, args, input_weights)


def _blocked_errors(
    weight: Tensor, moments: Moments, args: QuantArgs, input_weights: Tensor | None
) -> QuantErrors:
    """Quantize-dequantize in blocks of whole rows (rows: every dim but the last) with the same
    primitives as `quantize`: the squared error and, given input weights, the weighted NRMSE and
    the output error."""
    rows = weight.reshape(-1, weight.shape[-1]) if weight.ndim >= 2 else weight.reshape(1, -1)
    scale_dtype = scale_dtype_for(weight.dtype)
    if args.strategy == "tensor":
        scale, zero = tensor_qparams([moments], args, weight.dtype)
    else:
        args = fit_group_size(args, rows.shape[1])
    total, column_error, column_norm = 0.0, 0.0, 0.0
    step = max(1, CHUNK_ELEMENTS // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        block = rows[start : start + step].to(ACCUM_DTYPE)  # FP8 has no min/max; exact in fp32
        if args.strategy == "tensor":
            codes = quantize_grouped(block.view(1, 1, -1), scale.view(1, 1), _view11(zero), args)
            restored = scale_codes(codes, scale, zero).view(block.shape)
        else:
            restored = quantize_weight(block, args, scale_dtype=scale_dtype).dequantize()
        error = (block - restored).to(torch.float64)
        total += float(torch.dot(error.view(-1), error.view(-1)))
        if input_weights is not None:
            column_error = column_error + error.square().sum(0)
            column_norm = column_norm + block.to(torch.float64).square().sum(0)
    if input_weights is None:
        return total, None, None
    weights = input_weights.to(torch.float64)
    output = float((column_error * weights).sum())  # type: ignore[operator]
    reference = float((column_norm * weights).sum())  # type: ignore[operator]
    return total, math.sqrt(output / reference) if reference else 0.0, output
