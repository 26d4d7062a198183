"""Which weights to remove, from a score per weight (low scores go): a share of each row
(unstructured), or N:M (at most N non-zeros in every M consecutive inputs, along the input
dimension, as sparse tensor cores and compressed-tensors' 2:4 format read them).

Scores, weight W [out, in]:
- magnitude: |W|
- Wanda (arXiv 2306.11695): |W_ij| · ||X_j||, with ||X_j|| from the Hessian's diagonal
  (H = 2XᵀX/n, so sqrt(H_jj) is ||X_j|| up to one constant, which no row comparison sees)
- SparseGPT (arXiv 2301.00774): W_ij² / [H⁻¹]_jj², taken inside GPTQ's solver per block
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Sparsity:
    """`fraction` of each row's weights removed, or the N:M `pattern` (keep n of every m)."""

    fraction: float | None = None
    pattern: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.pattern is None):
            raise ValueError("give either a fraction or an N:M pattern")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise ValueError(f"sparsity {self.fraction}: must be in (0, 1)")
        if self.pattern is not None and not 0 < self.pattern[0] < self.pattern[1]:
            raise ValueError(f"pattern {self.pattern}: needs 0 < N < M")

    @property
    def label(self) -> str:
        if self.pattern is not None:
            return f"{self.pattern[0]}:{self.pattern[1]}"
        return f"{self.fraction:.0%}"


def magnitude_scores(weight: Tensor) -> Tensor:
    return weight.abs().float()


def wanda_scores(weight: Tensor, input_norms: Tensor) -> Tensor:
    """|W_ij| · ||X_j|| for the L2 norms [in] of the linear's inputs (any common scale: each
    row is ranked on its own)."""
    return weight.abs().float() * input_norms.float()


def pruned_mask(scores: Tensor, sparsity: Sparsity, *, start: int = 0) -> Tensor:
    """True where a weight goes, for scores [rows, columns] of columns start..start+columns of
    a weight (a block of them, or all). Unstructured: each row loses its lowest-scored
    round(f·(start+columns)) - round(f·start) weights, so that blocks add up to round(f·in) a
    row. N:M: in each group of m columns (start must be a multiple of m), the m - n lowest."""
    rows, columns = scores.shape
    if sparsity.pattern is not None:
        n, m = sparsity.pattern
        if columns % m or start % m:
            raise ValueError(f"{columns} columns from {start}: not whole groups of {m}")
        groups = scores.reshape(rows, columns // m, m)
        drop = groups.topk(m - n, dim=-1, largest=False).indices
        mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, drop, True)
        return mask.reshape(rows, columns)
    fraction = float(sparsity.fraction or 0.0)
    count = round(fraction * (start + columns)) - round(fraction * start)
    mask = torch.zeros(rows, columns, dtype=torch.bool, device=scores.device)
    if count > 0:
        drop = scores.topk(count, dim=1, largest=False).indices
        mask.scatter_(1, drop, True)
    return mask
