"""AWQ (Lin et al., arXiv 2306.00978): scale the input channels that carry large activations
up before quantizing, and fold the inverse scale into whatever produces those activations.

    s = mean|x|^alpha / sqrt(max · min)        one scale per input channel, alpha searched on a grid
    W' = W · diag(s)                        the linears that read x
    norm' = norm / s   (or prev' = diag(1/s) · prev for a preceding linear)

Before quantization the model is unchanged (W' x' = W x). The search picks the alpha that
minimises the output error of the linears on the calibration inputs, computed exactly from
their Hessian H = 2 XᵀX / n:  ||ΔW X||² = n/2 · Σ_rows ΔW H ΔWᵀ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.quant.primitives import ACCUM_DTYPE, as_groups

# A weight quantizer for the search: weight [out, in] -> dequantized weight [out, in].
Quantizer = Callable[[Tensor], Tensor]


@dataclass(frozen=True, slots=True)
class ScaleSearch:
    scales: Tensor  # [in] the chosen s (all ones when alpha = 0 wins)
    alpha: float
    error: float  # Σ_rows ΔW H ΔWᵀ over the linears, at the chosen alpha
    error_unscaled: float  # the same without scaling (alpha = 0: plain RTN)


def output_error(delta: Tensor, hessian: Tensor) -> Tensor:
    """Σ_rows δ H δᵀ: the squared output error of a weight change δ [out, in] on the calibration
    inputs, times 2/n (H = 2 XᵀX / n)."""
    delta = delta.to(ACCUM_DTYPE)
    return ((delta @ hessian.to(ACCUM_DTYPE)) * delta).sum()


def search_scales(
    weights: list[tuple[Tensor, Quantizer]],
    mean_abs: Tensor,
    hessian: Tensor,
    *,
    grid: int = 20,
    weight_mean: Tensor | None = None,
) -> ScaleSearch:
    """The per-input-channel scales, for the linears in `weights` that share one input (each
    with its own quantizer), whose quantized outputs are closest to the float ones.
    weight_mean (see `weight_magnitude`) turns on duo scaling: s = mean|x|^a / mean|w|^(1-a)."""
    alphas = torch.linspace(0.0, 1.0, grid).tolist()
    candidates = [awq_scales(mean_abs, alpha, weight_mean) for alpha in alphas]
    errors = [_scaled_error(weights, scales, hessian) for scales in candidates]
    best = min(range(len(alphas)), key=errors.__getitem__)
    unscaled = _scaled_error(weights, torch.ones_like(candidates[0]), hessian)
    if unscaled <= errors[best]:  # scaling never makes it worse than plain RTN
        return ScaleSearch(torch.ones_like(candidates[0]), 0.0, unscaled, unscaled)
    return ScaleSearch(candidates[best], alphas[best], errors[best], unscaled)


def _scaled_error(
    weights: list[tuple[Tensor, Quantizer]], scales: Tensor, hessian: Tensor
) -> float:
    """Output error of quantizing W · diag(s) and undoing the scale: Q(W s) / s - W."""
    return float(
        sum(output_error(quantize(w * scales) / scales - w, hessian) for w, quantize in weights)
    )


def awq_scales(mean_abs: Tensor, alpha: float, weight_mean: Tensor | None = None) -> Tensor:
    """s = mean|x|^alpha (divided by mean|w|^(1-alpha) with duo scaling), normalised so that
    max(s) · min(s) = 1 (keeps weights in range)."""
    scales = mean_abs.to(ACCUM_DTYPE).clamp_min(1e-4).pow(alpha)
    if weight_mean is not None:
        scales = (scales / (weight_mean.to(ACCUM_DTYPE).pow(1 - alpha) + 1e-4)).clamp_min(1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


def weight_magnitude(weights: list[tuple[Tensor, QuantArgs]]) -> Tensor:
    """Mean over output rows (and over the linears) of |w| relative to its group's largest |w|,
    per input channel: how large each channel's weights are on the quantization grid."""
    means = []
    for weight, args in weights:
        groups = as_groups(weight.abs().to(ACCUM_DTYPE), args)
        relative = groups / groups.amax(dim=-1, keepdim=True).clamp_min(1e-12)
        means.append(relative.reshape(weight.shape).mean(dim=0))
    return torch.stack(means).mean(dim=0)


def fold_into_norm(norm_weight: Tensor, scales: Tensor, offset: float = 0.0) -> Tensor:
    """RMSNorm weight g' = g / s: the norm's output channel j shrinks by s_j. A norm that
    multiplies by (offset + g) (Gemma's, offset 1) gets g' = (offset + g) / s - offset."""
    return (norm_weight + offset) / scales.to(norm_weight.dtype) - offset


def fold_into_rows(weight: Tensor, scales: Tensor) -> Tensor:
    """A preceding linear's output rows (weight [out, in] or bias [out]) divided by s."""
    return weight / scales.to(weight.dtype).reshape(-1, *([1] * (weight.ndim - 1)))


def scale_columns(weight: Tensor, scales: Tensor) -> Tensor:
    """The consuming linear's input columns multiplied by s: W' = W · diag(s)."""
    return weight * scales.to(weight.dtype)
