"""GPTQ (Frantar et al., arXiv 2210.17323): quantize one column at a time and spread each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian.

    W: [out, in] weight    H = 2 XᵀX / n: [in, in] Hessian of the layer-output error
    Hinv = upper Cholesky factor of (H + λ·mean(diag H)·I)⁻¹
    for each column j:  q_j = Q(w_j);  e_j = (w_j - q_j) / Hinv[j, j];  W[:, j:] -= e_j Hinv[j, j:]

Updates are applied lazily in blocks of `block_size` columns (the result is the same, the
memory traffic much lower). Codes follow `to_code_grid_`, the same rounding as RTN.
Rows are independent given H: the loss is kept per row, so that linears sharing an input can
be quantized as one stacked weight and their losses told apart.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from llmq.config import QuantArgs, group_width
from llmq.errors import NumericalError
from llmq.quant.compiled import compiled_loop_applies, quantize_columns
from llmq.quant.floats import effective_scale, scale_storage
from llmq.quant.masks import Sparsity, pruned_mask
from llmq.quant.primitives import (
    ACCUM_DTYPE,
    FP8_DTYPE,
    DenseWeight,
    QuantizedWeight,
    as_groups,
    block_rows,
    clipped_qparams,
    expand_block_scale,
    group_ranges,
    int_range,
    to_code_grid_,
    weight_global_scale,
)

# When H + λI is not positive definite, λ is multiplied by this until it is, up to MAX_DAMPENING.
DAMPENING_STEP = 10.0
MAX_DAMPENING = 10.0


@dataclass(frozen=True, slots=True)
class GPTQResult:
    weight: QuantizedWeight | DenseWeight  # DenseWeight: SparseGPT pruning alone
    row_loss: Tensor  # [out] GPTQ's objective per row: Σ_j (w_ij - q_ij)² / (2 Hinv[j, j]²)
    dampening_frac: float  # the dampening used; larger than asked when Cholesky failed

    @property
    def loss(self) -> float:
        return float(self.row_loss.sum())


def gptq_quantize_weight(
    weight: Tensor,
    hessian: Tensor,
    args: QuantArgs | None,
    *,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: Literal["static", "none"] = "static",
    scale_dtype: torch.dtype | None = None,
    clip_ratio: Tensor | None = None,
    sparsity: Sparsity | None = None,
) -> GPTQResult:
    """GPTQ on one linear. weight: [out, in]; hessian: [in, in], float32 (or float64, then the
    whole algorithm runs in float64). clip_ratio [out, groups] shrinks each group's range.

    actorder="static" visits columns by decreasing H[j, j] with each group's scale fixed from
    the original weights, so groups stay contiguous and the checkpoint needs no g_idx.
    actorder="none" visits columns in order and takes each group's range from the weights as
    updated when the group starts (the paper's algorithm).

    `sparsity` makes it SparseGPT (arXiv 2301.00774) pruning and quantizing together: the mask
    is chosen from the updated weights by w² / Hinv[j, j]² (`pruned_mask`), a block's at its
    start (unstructured) or each N:M group's when the loop reaches it (`_SparseGPTMask`), and
    pruned weights get the code of zero, so their whole value is the residual spread over later
    columns. Columns are visited in order (N:M groups are consecutive inputs), with actorder
    "none". With `args` None it prunes alone: the same update with nothing rounded (kept
    weights have no residual), a float weight returned.
    """
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(
            f"Hessian shape {tuple(hessian.shape)} does not match weight {rows}x{cols}"
        )
    work = torch.float64 if hessian.dtype == torch.float64 else ACCUM_DTYPE
    scale_dtype = scale_dtype or (weight.dtype if weight.is_floating_point() else ACCUM_DTYPE)
    if sparsity is not None and actorder != "none":
        raise ValueError("SparseGPT visits columns in order: actorder 'none'")
    if args is None and sparsity is None:
        raise ValueError("nothing to do: no quantization arguments and no sparsity")
    w = weight.to(work).clone()
    h = hessian.to(work).clone()
    dead = h.diagonal() == 0  # inputs that were always zero: any weight there is free
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    params = None if args is None else _QParams(w, args, scale_dtype, clip_ratio, lazy=actorder == "none")  # fmt: skip
    order = (
        torch.argsort(h.diagonal(), descending=True, stable=True)
        if actorder == "static"
        else torch.arange(cols, device=w.device)
    )
    w, h = w[:, order], h[order][:, order]
    hinv, used_frac = inverse_hessian_factor(h, dampening_frac)
    row_loss = torch.zeros(rows, dtype=work, device=w.device)
    block_size = _aligned_block(block_size, args, sparsity)
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        # Transposed, so that a column and the later columns it updates are contiguous rows:
        # up to 2x faster than strided columns on weights with many rows (gate/up).
        block = w[:, start:end].T.contiguous()
        hinv_block = hinv[start:end, start:end]
        diagonal = hinv_block.diagonal()
        mask = None if sparsity is None else _SparseGPTMask(block, diagonal, sparsity, start)
        spread = hinv_block / diagonal.unsqueeze(1)
        if params is None:
            assert mask is not None
            residuals = _prune_block(block, spread, mask)
            w[:, start:end] = block.T
        else:
            residuals = _quantize_block(block, spread, params, order, start, mask)
        errors = residuals.T / diagonal
        row_loss += errors.pow(2).sum(dim=1) / 2
        w[:, end:] -= errors @ hinv[start:end, end:]
    if params is None:  # columns in order: no permutation to undo
        return GPTQResult(DenseWeight(w.to(weight.dtype)), row_loss, used_frac)
    scale, zero = params.stored()
    weight = QuantizedWeight(params.codes, scale, zero, args, params.global_scale)
    return GPTQResult(weight, row_loss, used_frac)


class _SparseGPTMask:
    """The weights SparseGPT prunes in one block [columns, rows], chosen span by span from the
    weights as the column loop has updated them: the whole block at its start (each row's
    share), or each group of an N:M pattern when the loop reaches its first column, as the
    paper's §3.4 and its reference code do; choosing all of a block's N:M groups at its start
    would ignore what the earlier columns' residuals moved."""

    def __init__(self, block: Tensor, diagonal: Tensor, sparsity: Sparsity, start: int) -> None:
        self.block, self.diagonal, self.sparsity, self.start = block, diagonal, sparsity, start
        self.span = sparsity.pattern[1] if sparsity.pattern is not None else len(block)
        self.pruned = torch.zeros_like(block, dtype=torch.bool)  # [columns, rows], as the block

    def choose(self, first: int) -> None:
        """The mask of the span that starts at column `first` of the block."""
        span = slice(first, first + self.span)
        scores = (self.block[span] / self.diagonal[span].unsqueeze(1)).square()
        self.pruned[span] = pruned_mask(scores.T, self.sparsity, start=self.start + first).T


def _prune_block(block: Tensor, spread: Tensor, mask: _SparseGPTMask) -> Tensor:
    """SparseGPT's inner loop without quantization (`block` [columns, rows], updated in place):
    each pruned weight's whole value is its residual, spread over the later columns; kept
    weights have none. Returns the residuals [columns, rows]."""
    residuals = torch.zeros_like(block)
    pruned = mask.pruned
    for i in range(len(block)):
        if i % mask.span == 0:
            mask.choose(i)
        torch.where(pruned[i], block[i], residuals[i], out=residuals[i])
        block[i].masked_fill_(pruned[i], 0.0)
        block[i + 1 :].addr_(spread[i, i + 1 :], residuals[i], alpha=-1)
    return residuals


def _quantize_block(
    block: Tensor,
    spread: Tensor,
    params: _QParams,
    order: Tensor,
    start: int,
    mask: _SparseGPTMask | None = None,
) -> Tensor:
    """GPTQ's inner loop over one block of columns (`block`: [columns, rows], updated in place):
    quantize each column, record its codes, and spread its rounding residual over the later
    columns of the block. `spread` row i holds Hinv[i, j] / Hinv[i, i], so that one fused
    multiply-add applies a residual. `mask` (SparseGPT): the weights that get the code of
    zero, chosen span by span as the loop reaches them. Returns the residuals [columns, rows].

    On a CPU the per-column op count, not the arithmetic, is GPTQ's cost: each column costs
    six in-place or out= ops on buffers and per-column scales gathered once per segment (the
    block, or one group when ranges come from the updated weights). The loop runs in pieces
    that start wherever a segment or a mask's span does.
    """
    residuals = torch.empty_like(block)
    codes = torch.empty(block.shape, dtype=torch.float64, device=block.device)
    integer_codes = params.args.type == "int"
    compiled = compiled_loop_applies(block, integer_codes)
    on_gpu = None if mask is not None else _gpu_column_loop(block, integer_codes)
    segment = params.group if params.lazy else len(block)
    piece = segment if mask is None else math.gcd(segment, mask.span)
    pruned = None if mask is None else mask.pruned
    for first in range(0, len(block), piece):
        if first % segment == 0:
            params.start_group(
                int(order[start + first]),
                w_block=block.T,
                block_start=start,
                position=start + first,
            )
            qparams = params.columns(order[start + first : start + first + segment])
        if mask is not None and first % mask.span == 0:
            mask.choose(first)
        at = first % segment
        scale, zero, dequant_scale = (None if t is None else t[at : at + piece] for t in qparams)
        if on_gpu is not None:
            on_gpu(
                block, spread, first, scale, zero, dequant_scale,
                int_range(params.args.num_bits), codes, residuals,
            )  # fmt: skip
        elif compiled:
            code_range = int_range(params.args.num_bits)
            quantize_columns(
                block, spread, first, scale, zero, dequant_scale, code_range, codes, residuals,
                pruned,
            )  # fmt: skip
        else:
            _quantize_columns(
                block, spread, first, (scale, zero, dequant_scale), params, codes, residuals,
                pruned,
            )  # fmt: skip
    params.codes[:, order[start : start + len(block)]] = codes.T.to(params.codes.dtype)
    return residuals


def _gpu_column_loop(block: Tensor, integer_codes: bool) -> Callable[..., None] | None:
    """The Triton column loop (`llmq.quant.gptq_triton`) when it serves this block: on a GPU, where
    the torch ops' per-column launches would bound the loop. Triton is imported only then."""
    if not block.is_cuda or importlib.util.find_spec("triton") is None:
        return None
    from llmq.quant import gptq_triton as kernel

    return kernel.quantize_columns_gpu if kernel.gpu_loop_applies(block, integer_codes) else None


def _quantize_columns(
    block: Tensor,
    spread: Tensor,
    first: int,
    qparams: tuple[Tensor, Tensor | None, Tensor],
    params: _QParams,
    codes: Tensor,
    residuals: Tensor,
    pruned: Tensor | None = None,
) -> None:
    """The column loop of `_quantize_block` in torch ops (GPUs, FP8 codes); on the CPU,
    `quantize_columns` does the same steps compiled."""
    scale, zero, dequant_scale = qparams
    shifted, dequantized = torch.empty_like(codes[0]), torch.empty_like(block[0])
    for j in range(len(scale)):
        i = first + j
        code = codes[i]
        torch.div(block[i], scale[j], out=code)  # float64, as RTN computes codes
        params.round_codes_(code, None if zero is None else zero[j])
        if pruned is not None:  # the code that dequantizes to exactly zero
            code.masked_fill_(pruned[i], 0.0) if zero is None else torch.where(pruned[i], zero[j], code, out=code)  # fmt: skip
        if zero is not None:
            code = torch.sub(code, zero[j], out=shifted)
        # the product of a code and a scale is exact in float64: rounding it to the working
        # dtype gives what that dtype's own product gives (`scale_codes`)
        torch.mul(code, dequant_scale[j], out=dequantized)
        torch.sub(block[i], dequantized, out=residuals[i])
        block[i + 1 :].addr_(spread[i, i + 1 :], residuals[i], alpha=-1)


def _code_dtype(args: QuantArgs) -> torch.dtype:
    return torch.float8_e4m3fn if args.type == "float" else torch.int8


def _aligned_block(
    block_size: int, args: QuantArgs | None, sparsity: Sparsity | None = None
) -> int:
    """A block holds whole groups, so a group's range is read from up-to-date weights, and
    whole N:M groups, so each is chosen at once."""
    group = group_width(args) if args is not None else None
    unit = math.lcm(group or 1, sparsity.pattern[1] if sparsity and sparsity.pattern else 1)
    return max(unit, block_size - block_size % unit)


def inverse_hessian_factor(h: Tensor, dampening_frac: float) -> tuple[Tensor, float]:
    """Upper Cholesky factor of (H + λ·mean(diag H)·I)⁻¹, raising λ step by step until H + λI
    is positive definite. Returns the factor and the λ used. Damps `h` in place: at most three
    [in, in] matrices live at once (H, its factor, the inverse), which matters for a 70B
    down_proj (28672² floats = 3.3 GB each)."""
    diagonal = h.diagonal()
    mean_diagonal = float(diagonal.mean())
    frac, added = dampening_frac, 0.0
    while True:
        diagonal += (frac - added) * mean_diagonal
        added = frac
        lower, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(lower)
            del lower
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0 and torch.isfinite(upper).all():
                return upper, frac
        if frac * DAMPENING_STEP > MAX_DAMPENING or not mean_diagonal > 0:
            raise NumericalError(
                f"the Hessian is not positive definite even with dampening {frac:g}",
                hint="use more calibration samples, or --method rtn for this model",
            )
        frac *= DAMPENING_STEP


class _QParams:
    """Scales and zero points of one weight, per row and column group (a block's scale is
    repeated on each of its rows): computed up front from the original weights, or (lazy)
    from the updated weights when GPTQ reaches a group's first column."""

    def __init__(
        self,
        weight: Tensor,
        args: QuantArgs,
        scale_dtype: torch.dtype,
        clip_ratio: Tensor | None,
        *,
        lazy: bool,
    ) -> None:
        self.args = args
        self.scale_dtype = scale_storage(args, scale_dtype)
        self.global_scale = weight_global_scale(weight, args)  # NVFP4: from the original weight
        self.work = weight.dtype  # GPTQ's working dtype: dequantized columns are rounded to it
        self.ratio = clip_ratio
        self.group = int(group_width(args) or weight.shape[1])
        self.lazy = lazy and self.group < weight.shape[1]
        rows, cols = weight.shape
        self.scale = torch.empty(
            rows, cols // self.group, dtype=self.scale_dtype, device=weight.device
        )
        self.zero = None if args.symmetric or args.type == "float" else self.scale.to(torch.int8)
        self.codes = torch.empty(rows, cols, dtype=_code_dtype(args), device=weight.device)
        if not self.lazy:
            self._set(slice(None), weight)

    def _set(self, groups: slice, weight: Tensor) -> None:
        """The qparams of `groups` from `weight` (their columns), by `quantize_weight`'s rule."""
        ranges = group_ranges(as_groups(weight, self.args))
        ratio = 1.0 if self.ratio is None else self.ratio[:, groups]
        scale, zero = clipped_qparams(ranges, self.args, self.scale_dtype, ratio, self.global_scale)
        rows = self.scale.shape[0]
        self.scale[:, groups] = expand_block_scale(scale, self.args, rows).expand(rows, -1)
        if self.zero is not None and zero is not None:
            self.zero[:, groups] = zero

    def start_group(self, column: int, *, w_block: Tensor, block_start: int, position: int) -> None:
        """Lazy mode: at a group's first column, set its range from the updated weights (the
        block holds the whole group, see `_aligned_block`)."""
        if not self.lazy or column % self.group:
            return
        local = position - block_start
        group = column // self.group
        self._set(slice(group, group + 1), w_block[:, local : local + self.group])

    def columns(self, columns: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """Per-column quantization parameters, one row per column of `columns`: the scale and
        zero point in float64 (the dtype codes are computed in) and the scale as the working
        dtype holds it (for dequantization)."""
        groups = torch.div(columns, self.group, rounding_mode="floor").to(self.scale.device)
        scale = self.scale.T[groups]  # contiguous rows: a column's scales are one row
        zero = None if self.zero is None else self.zero.T[groups].to(torch.float64)
        if self.global_scale is not None:  # NVFP4: codes of the float32 effective scale
            effective = effective_scale(scale, self.global_scale).to(torch.float64)
            return effective, zero, effective
        return scale.to(torch.float64), zero, scale.to(self.work).to(torch.float64)

    def round_codes_(self, scaled: Tensor, zero: Tensor | None) -> None:
        """Codes from weights divided by their scale, in place, as `quantize_grouped` rounds
        them (float64 values: integers, or FP8 / FP4 values)."""
        to_code_grid_(scaled, zero, self.args)
        if self.args.type == "float":
            scaled.copy_(scaled.to(FP8_DTYPE))

    def stored(self) -> tuple[Tensor, Tensor | None]:
        """Scale and zero point in the layout `QuantizedWeight` stores."""
        if self.args.strategy == "block":  # one row per block, as stored; symmetric
            return self.scale[:: block_rows(self.args)].contiguous(), None
        if self.args.strategy != "tensor":
            return self.scale, self.zero
        zero = None if self.zero is None else self.zero[:1, :1].reshape(1)
        return self.scale[:1, :1].reshape(1), zero
