"""RTN (round to nearest), with an optional per-group MSE-optimal clipping search."""

from __future__ import annotations

import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.quant.primitives import QuantizedWeight, as_groups, quantize_weight

# Shrink factors tried by the clipping search: 1.0 down to 0.5 in 20 steps, as in GPTQ's
# `find_params(mse=True)` grid; the range shrinks toward zero.
CLIP_GRID = torch.linspace(1.0, 0.5, 20, dtype=torch.float64)


def rtn_quantize_weight(
    weight: Tensor, args: QuantArgs, *, scale_dtype: torch.dtype | None = None, clip: str = "none"
) -> QuantizedWeight:
    """Quantize weight [out, in] to nearest; clip="mse" picks each group's range shrink factor
    from CLIP_GRID minimising the group's squared quantization error."""
    if clip == "none" or args.type == "float":
        return quantize_weight(weight, args, scale_dtype=scale_dtype)
    best_ratio = mse_clip_ratios(weight, args, scale_dtype=scale_dtype)
    return quantize_weight(weight, args, scale_dtype=scale_dtype, clip_ratio=best_ratio)


def mse_clip_ratios(
    weight: Tensor, args: QuantArgs, *, scale_dtype: torch.dtype | None = None
) -> Tensor:
    """Per-group shrink factor [out or 1, groups] minimising ||w - deq(q(w))||² within the group."""
    groups = as_groups(weight, args).to(torch.float32)
    best_err = torch.full(groups.shape[:2], float("inf"), dtype=torch.float64)
    best_ratio = torch.ones(groups.shape[:2], dtype=torch.float64)
    for ratio in CLIP_GRID:
        q = quantize_weight(weight, args, scale_dtype=scale_dtype, clip_ratio=ratio)
        err = (as_groups(q.dequantize(), args) - groups).double().pow(2).sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, ratio, best_ratio)
    return best_ratio
