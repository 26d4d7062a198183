"""GPTQ on GGUF grids: with correlated inputs its codes cut the output error that nearest
rounding on the same grid leaves; with uncorrelated inputs (an identity Hessian) it has nothing
to feed forward and gives the nearest codes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmq.gguf.blocks import codes_for, dequantized, pack
from llmq.gguf.gptq import gptq_codes
from llmq.gguf.grids import choose_grid


def _layer(cols: int = 512, rows: int = 48, tokens: int = 4096):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    mixing = torch.randn(cols, cols, generator=generator) / cols**0.5 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=generator) @ mixing  # correlated channels
    return weight.numpy(), x, 2 * x.T @ x / tokens


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
def test_error_feedback_cuts_the_output_error_of_nearest_rounding(qtype: str) -> None:
    weight, x, hessian = _layer()
    grid = choose_grid(qtype, weight, hessian.diagonal().numpy() / 2)
    nearest, fed = codes_for(grid, weight), gptq_codes(grid, weight, hessian)
    errors = {}
    for name, codes in (("nearest", nearest), ("gptq", fed)):
        decoded = dequantized(grid, codes)
        assert np.array_equal(gguf.quants.dequantize(pack(grid, codes), grid.qtype), decoded)
        errors[name] = float(((torch.from_numpy(decoded - weight) @ x.T) ** 2).mean())
    assert errors["gptq"] < 0.8 * errors["nearest"], errors


def test_an_identity_hessian_gives_the_nearest_codes() -> None:
    weight, _, _ = _layer()
    grid = choose_grid("Q4_K", weight)
    assert np.array_equal(gptq_codes(grid, weight, torch.eye(512)), codes_for(grid, weight))
