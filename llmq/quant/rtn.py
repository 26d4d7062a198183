"""RTN (round to nearest), with an optional per-group clipping search."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.quant.compiled import clip_deltas, compiled_loop_applies
from llmq.quant.primitives import (
    QuantizedWeight,
    as_groups,
    block_rows,
    clipped_qparams,
    group_ranges,
    int_range,
    quantize_weight,
)

# Shrink factors tried by the clipping search: 1.0 down to 0.5 in 20 steps, as in GPTQ's
# `find_params(mse=True)` grid; the range shrinks toward zero.
CLIP_GRID = torch.linspace(1.0, 0.5, 20, dtype=torch.float64)


def rtn_quantize_weight(
    weight: Tensor,
    args: QuantArgs,
    *,
    scale_dtype: torch.dtype | None = None,
    clip: str = "none",
    hessian: Tensor | None = None,
) -> QuantizedWeight:
    """Quantize weight [out, in] to nearest. clip="mse" picks each group's range shrink factor
    from CLIP_GRID minimising the group's squared weight error; clip="output" minimises the
    group's output error on the calibration inputs instead (needs their `hessian`)."""
    if clip == "none":
        return quantize_weight(weight, args, scale_dtype=scale_dtype)
    ratio = clip_ratios(
        weight, args, scale_dtype=scale_dtype, hessian=output_hessian(clip, hessian)
    )
    return quantize_weight(weight, args, scale_dtype=scale_dtype, clip_ratio=ratio)


def output_hessian(clip: str, hessian: Tensor | None) -> Tensor | None:
    """The Hessian that weights the clipping error: None (plain weight MSE) for clip="mse"."""
    if clip != "output":
        return None
    if hessian is None:
        raise ValueError('clip="output" needs the Hessian of the calibration inputs')
    return hessian


def clip_ratios(
    weight: Tensor,
    args: QuantArgs,
    *,
    scale_dtype: torch.dtype | None = None,
    hessian: Tensor | None = None,
) -> Tensor:
    """Per-group shrink factor [out or 1, groups] from CLIP_GRID minimising the group's error:
    ||Δw||² without a Hessian, Δw H_gg Δwᵀ (the group's share of the squared output error on
    the calibration inputs, cross-group terms left out as in AWQ's clip search) with one."""
    groups = as_groups(weight, args).to(torch.float32)
    blocks = None if hessian is None else _diagonal_blocks(hessian.to(torch.float32), groups.shape)
    rounding_error = _rounding_error(weight, groups, args, scale_dtype or weight.dtype)
    best_err = torch.full(groups.shape[:2], float("inf"), dtype=torch.float64, device=weight.device)
    best_ratio = torch.ones(groups.shape[:2], dtype=torch.float64, device=weight.device)
    for ratio in CLIP_GRID:
        delta = rounding_error(ratio)
        if blocks is None:
            err = delta.double().pow(2).sum(dim=-1).T
        else:  # a batched product, then the row-wise dot: einsum's plan was 1.5x slower
            err = torch.bmm(delta, blocks).mul_(delta).sum(dim=-1).T.double()
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, ratio, best_ratio)
    return best_ratio


def _rounding_error(
    weight: Tensor, groups: Tensor, args: QuantArgs, scale_dtype: torch.dtype
) -> Callable[[Tensor], Tensor]:
    """ratio -> dequantize(quantize_weight(weight, clip_ratio=ratio)) - weight, float32, as
    [groups, rows, n] (one product per diagonal block of H); `groups` is weight as [rows,
    groups, n] float32. On the CPU, integer codes take the compiled loop: one pass a ratio
    into one reused buffer, with the same bits."""
    if not compiled_loop_applies(groups, args.type == "int") or block_rows(args) != 1:
        by_group = groups.transpose(0, 1)
        return lambda ratio: (
            as_groups(quantize_weight(weight, args, scale_dtype=scale_dtype, clip_ratio=ratio).dequantize(), args)
            .transpose(0, 1)
            .sub_(by_group)
        )  # fmt: skip
    ranges = group_ranges(groups)
    deltas = torch.empty(groups.transpose(0, 1).shape, dtype=torch.float32)

    def compiled(ratio: Tensor) -> Tensor:
        scale, zero = clipped_qparams(ranges, args, scale_dtype, ratio)
        dequant_scale = scale.to(torch.float32).to(torch.float64)  # as `dequantize` reads it
        zero = None if zero is None else zero.to(torch.float64)
        code_range = int_range(args.num_bits)
        clip_deltas(groups, scale.to(torch.float64), zero, dequant_scale, code_range, deltas)
        return deltas

    return compiled


def _diagonal_blocks(hessian: Tensor, grouped_shape: torch.Size) -> Tensor:
    """H's diagonal blocks [groups, n, n], one per column group of a [rows, groups, n] view."""
    _, groups, n = grouped_shape
    if hessian.shape[0] != groups * n:  # per-tensor groups span rows: use the whole H per row
        raise ValueError("output clipping needs per-channel or per-group weight scales")
    blocks = hessian.reshape(groups, n, groups, n)
    return blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1)
