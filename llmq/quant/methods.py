"""Weight quantization methods, by name. The layer pipeline calls them; they only see tensors.

A method turns one linear's weight (and, if it asks for them, the statistics of that linear's
input) into a `QuantizedWeight`. GPTQ, AWQ and the pruners register here the same way RTN does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from llmq.config import QuantArgs, Recipe
from llmq.errors import InputError
from llmq.quant.primitives import QuantizedWeight
from llmq.quant.rtn import rtn_quantize_weight

if TYPE_CHECKING:  # statistics are produced by llmq.calib; methods only read them
    from llmq.calib.stats import InputStats


class Method(Protocol):
    name: str
    needs_hessian: bool  # the pipeline accumulates XᵀX per input when True

    def quantize_weight(
        self,
        weight: Tensor,
        args: QuantArgs,
        stats: InputStats | None,
        *,
        scale_dtype: torch.dtype,
    ) -> QuantizedWeight: ...


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


@dataclass(frozen=True, slots=True)
class RTN:
    """Round to nearest; `clip="mse"` searches each group's clipping range."""

    clip: str = "none"
    name: str = "rtn"
    needs_hessian: bool = False

    def quantize_weight(
        self, weight: Tensor, args: QuantArgs, stats: InputStats | None, *, scale_dtype: torch.dtype
    ) -> QuantizedWeight:
        return rtn_quantize_weight(weight, args, scale_dtype=scale_dtype, clip=self.clip)


@register_method("rtn")
def _rtn(recipe: Recipe) -> Method:
    return RTN(clip=recipe.clip)
