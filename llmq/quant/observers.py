"""Static activation scales: one per-tensor scale per linear input (or per KV cache tensor),
chosen on the calibration data and stored as `input_scale` (`k_scale`, `v_scale`).

absmax      the largest |x| seen: nothing saturates on the calibration data.
percentile  the PERCENTILE-th quantile of |x| on the sample rows: a few outliers saturate so
            that the bulk gets finer steps.
mse         the range (a fraction of absmax from MSE_RATIOS) whose quantize-dequantize has the
            smallest squared error on the sample rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.quant.primitives import ACCUM_DTYPE, fake_quantize, static_scale

PERCENTILE = 0.9999
MSE_RATIOS = torch.linspace(1.0, 0.2, 41, dtype=torch.float64)


def observe_scale(
    absmax: Tensor,
    samples: Tensor | None,
    args: QuantArgs,
    observer: str,
    *,
    scale_dtype: torch.dtype = ACCUM_DTYPE,
) -> Tensor:
    """The static scale [1] for inputs with per-channel `absmax` (exact, over every calibration
    token) and sample rows `samples` (needed by percentile and mse)."""
    top = float(absmax.max())
    if observer == "absmax":
        return static_scale(top, args, scale_dtype)
    if samples is None or samples.numel() == 0:
        raise ValueError(f"the {observer} observer needs sample rows of the inputs")
    values = samples.to(ACCUM_DTYPE)
    if observer == "percentile":
        flat = values.abs().flatten()
        rank = max(1, math.ceil(PERCENTILE * flat.numel()))
        return static_scale(float(flat.kthvalue(rank).values), args, scale_dtype)
    if observer == "mse":
        return min(
            (static_scale(top * float(ratio), args, scale_dtype) for ratio in MSE_RATIOS),
            key=lambda scale: float((fake_quantize(values, args, scale) - values).pow(2).sum()),
        )
    raise ValueError(f"unknown observer {observer!r}")
