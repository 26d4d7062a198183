"""AWQ's scale search and folding formulas, against direct computation."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.quant.awq import (
    awq_scales,
    fold_into_norm,
    fold_into_rows,
    output_error,
    scale_columns,
    search_scales,
    weight_magnitude,
)
from llmq.quant.primitives import quantize_weight

INT4_G64_ASYM = QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=False)


def rtn(weight: Tensor) -> Tensor:
    return quantize_weight(weight, INT4_G64_ASYM, scale_dtype=torch.float32).dequantize()


def test_output_error_is_the_squared_output_difference() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=gen, dtype=torch.float64)
    delta = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    hessian = 2 * x.T @ x / x.shape[0]
    direct = (x @ delta.T).pow(2).sum() * 2 / x.shape[0]
    assert abs(float(output_error(delta, hessian)) - float(direct)) < 1e-4 * float(direct)


def test_scales_are_normalised_powers_of_the_activation_magnitude() -> None:
    mean_abs = torch.tensor([0.5, 2.0, 8.0])
    s = awq_scales(mean_abs, 0.5)
    assert torch.allclose(s, torch.tensor([0.5, 1.0, 2.0]), rtol=1e-6)  # sqrt(x) / sqrt(max * min)
    assert torch.equal(awq_scales(mean_abs, 0.0), torch.ones(3))


def test_folds_preserve_the_product() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=gen)
    norm, prev, prev_bias = (
        torch.rand(32, generator=gen) + 0.5,
        torch.randn(32, 16, generator=gen),
        torch.randn(32, generator=gen),
    )
    weight = torch.randn(8, 32, generator=gen)
    s = awq_scales(torch.rand(32, generator=gen) * 10, 0.7)
    through_norm = (x * fold_into_norm(norm, s)) @ scale_columns(weight, s).T
    assert torch.allclose(through_norm, (x * norm) @ weight.T, rtol=1e-5, atol=1e-5)
    h = torch.randn(5, 16, generator=gen)
    through_linear = (h @ fold_into_rows(prev, s).T + fold_into_rows(prev_bias, s)) @ scale_columns(
        weight, s
    ).T
    assert torch.allclose(through_linear, (h @ prev.T + prev_bias) @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.integration
def test_search_beats_plain_rtn_on_real_activations(
    real_weights: dict[str, Tensor],
    real_hessians: dict[str, Tensor],
    real_mean_abs: dict[str, Tensor],
) -> None:
    for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):
        weight, hessian = real_weights[name], real_hessians[name]
        search = search_scales([(weight, rtn)], real_mean_abs[name], hessian)
        assert (
            abs(search.error_unscaled - float(output_error(rtn(weight) - weight, hessian)))
            <= 1e-3 * search.error_unscaled
        )
        assert search.error < 0.95 * search.error_unscaled, name
        scaled = rtn(weight * search.scales) / search.scales
        assert (
            abs(float(output_error(scaled - weight, hessian)) - search.error) <= 1e-3 * search.error
        )


def test_weight_magnitude_is_the_mean_relative_size_per_input_channel() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(4, 128, generator=gen)
    got = weight_magnitude([(weight, INT4_G64_ASYM)])
    groups = weight.abs().reshape(4, 2, 64)
    expected = (groups / groups.amax(dim=-1, keepdim=True)).reshape(4, 128).mean(dim=0)
    assert torch.allclose(got, expected)


@pytest.mark.integration
def test_duo_scaling_search_never_loses_to_plain_rtn(
    real_weights: dict[str, Tensor],
    real_hessians: dict[str, Tensor],
    real_mean_abs: dict[str, Tensor],
) -> None:
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        weight, hessian = real_weights[name], real_hessians[name]
        magnitude = weight_magnitude([(weight, INT4_G64_ASYM)])
        search = search_scales([(weight, rtn)], real_mean_abs[name], hessian, weight_mean=magnitude)
        assert search.error < 0.95 * search.error_unscaled, name
