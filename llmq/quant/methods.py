"""Weight quantization methods, by name. The layer pipeline calls them; they only see tensors.

A method turns one linear's weight (and, if it asks for them, the statistics of that linear's
input) into a `QuantizedWeight`. AWQ is a scale search the pipeline applies before the weight
quantizer (RTN for "awq", GPTQ for "awq+gptq"). The pruners are the same quantizers with a
mask: magnitude and Wanda prune, then RTN quantizes; SparseGPT prunes inside GPTQ's solver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from llmq.config import AWQConfig, GPTQConfig, QuantArgs, Recipe
from llmq.errors import InputError
from llmq.quant.gptq import gptq_quantize_weight
from llmq.quant.masks import Sparsity, magnitude_scores, pruned_mask, wanda_scores
from llmq.quant.primitives import DenseWeight, QuantizedWeight
from llmq.quant.rtn import clip_ratios, output_hessian, rtn_quantize_weight

if TYPE_CHECKING:  # statistics are produced by llmq.calib; methods only read them
    from llmq.calib.stats import InputStats


@dataclass(frozen=True, slots=True)
class MethodResult:
    weight: QuantizedWeight | DenseWeight  # DenseWeight: pruned alone
    row_loss: Tensor | None = None  # [out] the method's own objective (GPTQ's) per row, if any
    dampening_frac: float | None = None  # GPTQ: the dampening used (raised if Cholesky failed)
    warning: str | None = None  # numerical trouble handled by a documented fallback

    @property
    def loss(self) -> float | None:
        return None if self.row_loss is None else float(self.row_loss.sum())

    def split_rows(self, sizes: list[int]) -> list[MethodResult]:
        """One result per part of a row-stacked weight (`QuantizedWeight.split_rows`)."""
        parts = self.weight.split_rows(sizes)
        losses = [None] * len(sizes) if self.row_loss is None else self.row_loss.split(sizes)
        return [
            replace(self, weight=part, row_loss=loss)
            for part, loss in zip(parts, losses, strict=True)
        ]


class Method(Protocol):
    """Methods treat rows independently given per-row scales (channel, group): the pipeline
    quantizes linears that read one input as one weight stacked by rows."""

    name: str
    needs_hessian: bool  # the pipeline accumulates XᵀX per input when True
    needs_norms: bool  # ... and the sum of x_j² per input column (Wanda) when True
    awq: AWQConfig | None  # search and fold AWQ scales before quantizing, when set
    sparsity: Sparsity | None  # pruners: the share or N:M pattern removed

    def quantize_weight(
        self,
        weight: Tensor,
        args: QuantArgs | None,  # None: prune alone (the weight stays in floating point)
        stats: InputStats | None,
        *,
        scale_dtype: torch.dtype,
    ) -> MethodResult: ...


_METHODS: dict[str, Callable[[Recipe], Method]] = {}


def register_method(
    name: str,
) -> Callable[[Callable[[Recipe], Method]], Callable[[Recipe], Method]]:
    def add(factory: Callable[[Recipe], Method]) -> Callable[[Recipe], Method]:
        _METHODS[name] = factory
        return factory

    return add


def method_names() -> list[str]:
    return sorted(_METHODS)


def get_method(recipe: Recipe) -> Method:
    try:
        factory = _METHODS[recipe.method]
    except KeyError:
        raise InputError(
            f"unknown method {recipe.method!r}", hint=f"choose one of: {', '.join(method_names())}"
        ) from None
    return factory(recipe)


def _input_norms(stats: InputStats | None) -> Tensor:
    """||X_j|| of each input column: from the sums of squares, or a Hessian's diagonal (what a
    --calib-stats file holds)."""
    if stats is not None and stats.sq_sum is not None:
        return stats.sq_sum.clamp_min(0).sqrt()
    if stats is not None and stats.hessian is not None:
        return stats.hessian.diagonal().clamp_min(0).sqrt()
    raise InputError(
        "wanda needs the norms of each linear's input",
        hint="run with calibration data, or give --calib-stats collected with --hessian",
    )


def _hessian(stats: InputStats | None, method: str) -> Tensor:
    if stats is None or stats.hessian is None:
        raise InputError(
            f"{method} needs the Hessian of each linear's input",
            hint="run with calibration data, or collect it with `llmq calibrate --hessian`",
        )
    return stats.hessian


@dataclass(frozen=True, slots=True)
class RTN:
    """Round to nearest; `clip` searches each group's clipping range (mse: weight error,
    output: output error on the calibration data). With `sparsity`, the weights with the lowest
    `score` (magnitude: |W|; wanda: |W|·||X_j||) are set to zero first: pruned, then quantized,
    and zero quantizes to exactly zero in every scheme."""

    clip: str = "none"
    awq: AWQConfig | None = None
    name: str = "rtn"
    sparsity: Sparsity | None = None
    score: str = "magnitude"

    @property
    def needs_hessian(self) -> bool:
        return self.clip == "output" or self.awq is not None

    @property
    def needs_norms(self) -> bool:
        """Wanda reads only ||X_j||: one forward pass, no XᵀX (K² work a token)."""
        return self.score == "wanda"

    def quantize_weight(
        self,
        weight: Tensor,
        args: QuantArgs | None,
        stats: InputStats | None,
        *,
        scale_dtype: torch.dtype,
    ) -> MethodResult:
        hessian = _hessian(stats, self.name) if self.needs_hessian else None
        if self.sparsity is not None:
            scores = wanda_scores(weight, _input_norms(stats)) if self.needs_norms else magnitude_scores(weight)  # fmt: skip
            weight = weight.masked_fill(pruned_mask(scores, self.sparsity), 0)
        if args is None:
            return MethodResult(DenseWeight(weight))
        q = rtn_quantize_weight(
            weight, args, scale_dtype=scale_dtype, clip=self.clip,
            hessian=hessian if self.clip == "output" else None,
        )  # fmt: skip
        return MethodResult(q)


@dataclass(frozen=True, slots=True)
class GPTQ:
    """GPTQ on each linear's Hessian; `clip` picks the group ranges as RTN's does."""

    config: GPTQConfig
    clip: str = "none"
    awq: AWQConfig | None = None
    name: str = "gptq"
    needs_hessian: bool = True
    needs_norms: bool = False
    sparsity: Sparsity | None = None  # SparseGPT: prune in the solver, columns in order

    def quantize_weight(
        self,
        weight: Tensor,
        args: QuantArgs | None,
        stats: InputStats | None,
        *,
        scale_dtype: torch.dtype,
    ) -> MethodResult:
        hessian = _hessian(stats, self.name)
        ratio = None
        if self.clip != "none" and args is not None:
            ratio = clip_ratios(
                weight, args, scale_dtype=scale_dtype, hessian=output_hessian(self.clip, hessian)
            )
        result = gptq_quantize_weight(
            weight, hessian, args, block_size=self.config.block_size,
            dampening_frac=self.config.dampening_frac,
            actorder="none" if self.sparsity is not None else self.config.actorder,
            scale_dtype=scale_dtype, clip_ratio=ratio, sparsity=self.sparsity,
        )  # fmt: skip
        warning = None
        if result.dampening_frac > self.config.dampening_frac:
            warning = (
                f"Hessian not positive definite with dampening {self.config.dampening_frac:g}; "
                f"used {result.dampening_frac:g}. More calibration samples usually avoid this."
            )
        return MethodResult(result.weight, result.row_loss, result.dampening_frac, warning)


@register_method("rtn")
def _rtn(recipe: Recipe) -> Method:
    return RTN(clip=recipe.clip)


@register_method("awq")
def _awq(recipe: Recipe) -> Method:
    return RTN(clip=recipe.clip, awq=recipe.awq, name="awq")


@register_method("gptq")
def _gptq(recipe: Recipe) -> Method:
    return GPTQ(recipe.gptq, clip=recipe.clip)


@register_method("awq+gptq")
def _awq_gptq(recipe: Recipe) -> Method:
    return GPTQ(recipe.gptq, clip=recipe.clip, awq=recipe.awq, name="awq+gptq")


def _sparsity(recipe: Recipe) -> Sparsity:
    return Sparsity(fraction=recipe.sparsity, pattern=recipe.nm_pattern)


@register_method("magnitude")
def _magnitude(recipe: Recipe) -> Method:
    return RTN(clip=recipe.clip, name="magnitude", sparsity=_sparsity(recipe))


@register_method("wanda")
def _wanda(recipe: Recipe) -> Method:
    return RTN(clip=recipe.clip, name="wanda", sparsity=_sparsity(recipe), score="wanda")


@register_method("sparsegpt")
def _sparsegpt(recipe: Recipe) -> Method:
    return GPTQ(recipe.gptq, clip=recipe.clip, name="sparsegpt", sparsity=_sparsity(recipe))
