"""SmoothQuant (Xiao et al., arXiv 2211.10438): move the range of activation outliers into the
weights before quantizing both, so that per-token (or per-tensor) activation scales stop being
set by a few outlier channels.

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)     one scale per input channel j
    X' = X · diag(1/s)  (folded into the preceding norm or linear),  W' = W · diag(s)

Before quantization the model is unchanged (X' W'ᵀ = X Wᵀ). alpha = 0.5 is the paper's default;
"auto" picks alpha per norm/linear pairing by the output error of the consumers with both
their weights and their inputs quantized, on sample rows of the calibration inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from llmq.quant.awq import Quantizer
from llmq.quant.primitives import ACCUM_DTYPE

AUTO_ALPHAS = tuple(round(0.1 * i, 1) for i in range(11))  # 0, 0.1, ..., 1
SEARCH_ROWS = 256  # sample rows the error is measured on (evenly spaced over the samples)
_FLOOR = 1e-5  # as llm-compressor: no channel's max (or scale) below this

# Input quantize-dequantize for the search: (inputs after scaling, their per-channel absmax) ->
# what the linear reads (the absmax gives static per-tensor scales without another pass).
ActivationQuantizer = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True, slots=True)
class SmoothSearch:
    scales: Tensor | None  # [in] the chosen s; None: leaving the pairing unscaled was best
    alpha: float | None
    error: float  # squared output error of the consumers at the chosen scales, on the samples
    error_unsmoothed: float  # the same without smoothing


def smooth_scales(act_absmax: Tensor, weight_absmax: Tensor, alpha: float) -> Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), floored so that no channel divides by 0."""
    act = act_absmax.to(ACCUM_DTYPE).clamp_min(_FLOOR)
    weight = weight_absmax.to(ACCUM_DTYPE).clamp_min(_FLOOR)
    return (act.pow(alpha) / weight.pow(1.0 - alpha)).clamp_min(_FLOOR)


def weight_column_absmax(weights: list[Tensor]) -> Tensor:
    """max |W_j| per input channel over every consumer's rows."""
    return torch.stack([w.abs().amax(dim=0).to(ACCUM_DTYPE) for w in weights]).amax(dim=0)


def search_smoothing(
    weights: list[tuple[Tensor, Quantizer]],
    act_absmax: Tensor,
    samples: Tensor,
    quantize_inputs: ActivationQuantizer,
    alphas: tuple[float, ...],
    *,
    keep_unsmoothed: bool,
) -> SmoothSearch:
    """The alpha in `alphas` whose scales give the smallest output error of the consumers with
    weights and inputs quantized; `keep_unsmoothed` also lets no scaling win (auto)."""
    x = _spread_rows(samples.to(ACCUM_DTYPE), SEARCH_ROWS)
    references = [x @ w.to(ACCUM_DTYPE).T for w, _ in weights]
    column_max = weight_column_absmax([w for w, _ in weights])
    unsmoothed = _error(
        weights, references, x, torch.ones_like(act_absmax), act_absmax, quantize_inputs
    )
    best = SmoothSearch(None, None, float("inf"), unsmoothed)
    for alpha in alphas:
        scales = smooth_scales(act_absmax, column_max, alpha)
        error = _error(weights, references, x, scales, act_absmax, quantize_inputs)
        if error < best.error:
            best = SmoothSearch(scales, alpha, error, unsmoothed)
    if keep_unsmoothed and unsmoothed <= best.error:
        return SmoothSearch(None, None, unsmoothed, unsmoothed)
    return best


def _error(
    weights: list[tuple[Tensor, Quantizer]],
    references: list[Tensor],
    x: Tensor,
    scales: Tensor,
    act_absmax: Tensor,
    quantize_inputs: ActivationQuantizer,
) -> float:
    """Σ ||Q_a(X / s) · Q_w(W · s)ᵀ - X Wᵀ||² over the consumers."""
    inputs = quantize_inputs(x / scales, act_absmax.to(ACCUM_DTYPE) / scales)
    total = 0.0
    for (weight, quantize), reference in zip(weights, references, strict=True):
        quantized = quantize(weight.to(ACCUM_DTYPE) * scales)
        total += float(torch.linalg.vector_norm(inputs @ quantized.T - reference)) ** 2
    return total


def _spread_rows(samples: Tensor, count: int) -> Tensor:
    """At most `count` rows, evenly spaced (samples come in calibration order)."""
    if len(samples) <= count:
        return samples
    index = torch.linspace(0, len(samples) - 1, count).round().long()
    return samples[index]
