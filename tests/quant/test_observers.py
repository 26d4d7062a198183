"""Static activation observers on heavy-tailed inputs, against direct float64 computations."""

from __future__ import annotations

import pytest
import torch

from llmq.config import QuantArgs
from llmq.quant.observers import PERCENTILE, observe_scale
from llmq.quant.primitives import FP8_MAX, fake_quantize

INT8 = QuantArgs(num_bits=8, strategy="tensor")
FP8 = QuantArgs(num_bits=8, type="float", strategy="tensor")


def heavy_tailed() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2048, 64, generator=gen)
    x[::97, 7] *= 80  # rare, large outliers
    return x


def squared_error(x: torch.Tensor, args: QuantArgs, scale: torch.Tensor) -> float:
    return float((fake_quantize(x, args, scale) - x).double().pow(2).sum())


@pytest.mark.parametrize("args", [INT8, FP8], ids=["int8", "fp8"])
def test_absmax_covers_the_largest_value(args: QuantArgs) -> None:
    x = heavy_tailed()
    scale = observe_scale(x.abs().amax(0), None, args, "absmax")
    limit = FP8_MAX if args.type == "float" else 127
    assert float(scale) == pytest.approx(float(x.abs().max()) / limit, rel=1e-6)


def test_percentile_saturates_only_the_tail() -> None:
    x = heavy_tailed()
    scale = observe_scale(x.abs().amax(0), x, INT8, "percentile")
    clip = float(scale) * 127
    beyond = float((x.abs() > clip * (1 + 1e-6)).double().mean())
    assert beyond <= 1 - PERCENTILE + 1e-6
    assert clip < float(x.abs().max())


@pytest.mark.parametrize("args", [INT8, FP8], ids=["int8", "fp8"])
def test_mse_beats_absmax_on_heavy_tails(args: QuantArgs) -> None:
    x = heavy_tailed()
    absmax = observe_scale(x.abs().amax(0), x, args, "absmax")
    mse = observe_scale(x.abs().amax(0), x, args, "mse")
    assert squared_error(x, args, mse) <= squared_error(x, args, absmax)
    if args.type == "int":  # int8's uniform grid wastes steps on the outliers' range
        assert float(mse) < float(absmax)


def test_sample_based_observers_need_samples() -> None:
    with pytest.raises(ValueError, match="sample rows"):
        observe_scale(torch.ones(4), None, INT8, "mse")
