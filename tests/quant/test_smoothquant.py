"""SmoothQuant's scales against the paper's formula in float64, and its search on inputs with
outlier channels (where it must help) and without (where auto must not hurt)."""

from __future__ import annotations

import torch

from llmq.config import QuantArgs
from llmq.pipeline.scaling import input_quantizer, rtn_quantizer
from llmq.quant.smoothquant import AUTO_ALPHAS, search_smoothing, smooth_scales

W8 = QuantArgs(num_bits=8, strategy="channel")
A8 = QuantArgs(num_bits=8, strategy="token", dynamic=True)


def test_scales_follow_the_paper_formula() -> None:
    torch.manual_seed(0)
    act, weight = torch.rand(64) * 10, torch.rand(64)
    act[3] = 0  # a dead channel: floored, no division by zero
    for alpha in (0.0, 0.5, 0.8, 1.0):
        expected = act.double().clamp_min(1e-5) ** alpha / weight.double() ** (1 - alpha)
        torch.testing.assert_close(
            smooth_scales(act, weight, alpha).double(), expected, rtol=1e-5, atol=0
        )


def outlier_inputs(scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [512, 128] with three outlier channels `scale` times larger, and a weight."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 128, generator=gen)
    x[:, [5, 40, 99]] *= scale
    return x, torch.randn(96, 128, generator=gen) * 0.05


def smoothing_errors(scale: float, alphas: tuple[float, ...], *, keep: bool) -> tuple[float, float]:
    x, w = outlier_inputs(scale)
    search = search_smoothing(
        [(w, rtn_quantizer(W8, torch.float32))], x.abs().amax(0), x, input_quantizer(A8),
        alphas, keep_unsmoothed=keep,
    )  # fmt: skip
    return search.error, search.error_unsmoothed


def test_smoothing_outlier_channels_cuts_the_w8a8_output_error() -> None:
    smoothed, plain = smoothing_errors(60.0, (0.5,), keep=False)
    assert smoothed < 0.5 * plain  # per-token int8 scales no longer set by three channels


def test_auto_never_does_worse_than_no_smoothing() -> None:
    for scale in (1.0, 60.0):
        chosen, plain = smoothing_errors(scale, AUTO_ALPHAS, keep=True)
        assert chosen <= plain


def test_static_input_quantizer_uses_the_scaled_absmax() -> None:
    static = QuantArgs(num_bits=8, strategy="tensor")
    x = torch.randn(16, 32)
    absmax = x.abs().amax(0)
    quantized = input_quantizer(static)(x, absmax)
    step = float(absmax.max()) / 127
    assert float((quantized - x).abs().max()) <= step / 2 + 1e-6
