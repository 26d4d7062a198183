"""GPTQ's error feedback on a GGUF grid: codes chosen column by column so that each rounding
error is compensated by the columns not yet rounded (arXiv 2210.17323), on the block scales and
mins the grid search fixed beforehand.

llama.cpp rounds every weight to its nearest code on an importance-weighted grid; the grid here
is the same search's, so what GPTQ adds is only the choice of codes. The grid is fixed before
the loop, as static act-order fixes GPTQ's groups, so the file's scales are the ones searched.
Columns are visited in order.

The loop is GPTQ's own (`llmq.quant.compiled.quantize_columns` on the CPU): a code is
round(w / step + offset / step) clamped to the type's range, so step·code - offset is the
decoded value, and the residual w - decoded is spread over the block's later columns.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from llmq.gguf.blocks import Grid
from llmq.quant.compiled import quantize_columns
from llmq.quant.gptq import inverse_hessian_factor

BLOCK_COLUMNS = 128  # columns per lazy batch update, as GPTQ's default


def gptq_codes(
    grid: Grid, weight: np.ndarray, hessian: Tensor, *, dampening_frac: float = 0.01
) -> np.ndarray:
    """Codes int8 [rows, cols] of `weight` [rows, cols] on `grid`, with the rounding errors fed
    forward through the inverse of `hessian` [cols, cols] (2·XᵀX / tokens of the linear's
    inputs). Groups whose step is zero (all-zero weights) get code 0, as rounding gives them."""
    rows, cols = weight.shape
    w = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)).clone()
    h = hessian.to(torch.float32).clone()
    dead = h.diagonal() == 0  # inputs never seen: any weight there is free
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    hinv, _used = inverse_hessian_factor(h, dampening_frac)
    step = torch.from_numpy(grid.step).double()
    usable = step != 0
    divisor = torch.where(usable, step, 1.0)
    zero = torch.where(usable, torch.from_numpy(grid.offset).double() / divisor, 0.0)
    code_range = (grid.spec.code_min, grid.spec.code_max)
    group_of = torch.arange(cols) // grid.spec.group_size
    codes = torch.empty(rows, cols, dtype=torch.float64)
    for start in range(0, cols, BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, cols)
        block = w[:, start:end].T.contiguous()
        inverse = hinv[start:end, start:end]
        diagonal = inverse.diagonal()
        spread = (inverse / diagonal.unsqueeze(1)).contiguous()
        groups = group_of[start:end]
        per_column = [t.T[groups].contiguous() for t in (divisor, zero, step)]
        block_codes = torch.empty_like(block, dtype=torch.float64)
        residuals = torch.empty_like(block)
        quantize_columns(block, spread, 0, *per_column, code_range, block_codes, residuals)
        codes[:, start:end] = block_codes.T
        errors = residuals.T / diagonal
        w[:, end:] -= errors @ hinv[start:end, end:]
    codes[~usable.repeat_interleave(grid.spec.group_size, dim=1)] = 0.0
    return codes.to(torch.int8).numpy()
