"""What the budget solver chooses for: the decoder's linears, grouped into units that must share
one scheme, and the candidates they choose among (each one's stored bits and rounding).

vLLM fuses q/k/v into one qkv_proj and gate/up into one gate_up_proj, and runs a layer's experts
as one fused kernel: each of those needs one scheme. So a unit is a group of linears that read
one input (the family layout's `sequential` groups), except that all of a layer's experts form
one unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from llmq.calib.stats import ACCUM_DTYPE
from llmq.config import QuantArgs, fit_group_size
from llmq.config.mixed import DENSE, candidate_args
from llmq.io.layout import DecoderLayout
from llmq.pack.sizes import stored_bytes
from llmq.quant.rtn import rtn_quantize_weight


@dataclass(frozen=True, slots=True)
class Linear:
    """One decoder linear the solver chooses a scheme for."""

    name: str  # full module name
    rows: int
    columns: int
    dtype: torch.dtype  # the stored weight's (dense linears and scales keep it)

    @property
    def numel(self) -> int:
        return self.rows * self.columns


class Candidate(Protocol):
    """One way a linear may be stored: what it costs and what a reader gets back."""

    name: str

    def bits(self, linear: Linear) -> int:
        """The bits `linear` takes stored this way, as written."""

    def stored_as(self, linear: Linear) -> str:
        """What the report calls the stored form (after any fitting to the linear's shape)."""

    def rounded(self, weight: Tensor, linear: Linear, importance: Tensor | None) -> Tensor | None:
        """`weight` [rows, columns] as stored and read back (ACCUM_DTYPE); None: stored exactly.
        `importance` [columns]: each input's mean square, where the format searches with it."""


@dataclass(frozen=True, slots=True)
class SchemeCandidate:
    """A compressed-tensors candidate: pack-quantized integer weights, or dense (args None)."""

    name: str
    args: QuantArgs | None

    def fitted(self, linear: Linear) -> QuantArgs | None:
        """The arguments as `linear` takes them: a group size its width is not a multiple of
        becomes the largest one that divides it (as `quantize` does)."""
        return None if self.args is None else fit_group_size(self.args, linear.columns)

    def bits(self, linear: Linear) -> int:
        return 8 * stored_bytes(self.fitted(linear), linear.rows, linear.columns, linear.dtype)

    def stored_as(self, linear: Linear) -> str:
        args = self.fitted(linear)
        return DENSE if args is None else args.label

    def rounded(self, weight: Tensor, linear: Linear, importance: Tensor | None) -> Tensor | None:
        args = self.fitted(linear)
        if args is None:
            return None
        return rtn_quantize_weight(weight, args, scale_dtype=linear.dtype).dequantize(ACCUM_DTYPE)


def scheme_candidates(names: tuple[str, ...]) -> list[SchemeCandidate]:
    return [SchemeCandidate(name, candidate_args(name)) for name in names]


KEPT = SchemeCandidate(DENSE, None)  # a linear left at its stored dtype


def choice_units(layout: DecoderLayout, prefix: str, linears: list[Linear]) -> list[list[Linear]]:
    """One layer's `linears` (`layout` is that layer's; names under `prefix`) in units that
    share a scheme, in execution order."""
    unit_of: dict[str, int] = {}
    for index, group in enumerate(layout.sequential):
        for name in group:
            unit_of[name] = index
    units: dict[object, list[Linear]] = {}
    for linear in linears:
        local = linear.name[len(prefix) :]
        key = "experts" if layout.expert_of(local) is not None else unit_of[local]
        units.setdefault(key, []).append(linear)
    return list(units.values())
