"""Helpers for kernel tests: poisoned outputs and the float64 error bound each precision allows."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def poisoned(m: int, n: int, dtype: torch.dtype) -> Tensor:
    """An output buffer full of NaN: a tile the kernel forgets to write fails the check."""
    return torch.full((m, n), float("nan"), dtype=dtype)


def assert_within_bound(out: Tensor, exact: Tensor, magnitude: Tensor, dtype: torch.dtype) -> None:
    """|out - exact| <= 3u * magnitude + 1e-6 * magnitude, elementwise, where exact is the float64
    product and magnitude = |x| @ |W|^T (the sum of absolute terms, which bounds the rounding of
    operands, of the float32 accumulation and of the output). u: the output dtype's unit
    roundoff; operands are rounded to the dot dtype, no coarser than the output's."""
    assert not torch.isnan(out).any(), "output has NaN: a tile was not written"
    bound = (3 * UNIT_ROUNDOFF[dtype] + 1e-6) * magnitude + 1e-30
    excess = (out.double() - exact).abs() / bound
    worst = excess.max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound"
