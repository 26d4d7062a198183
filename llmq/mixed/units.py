"""What the budget solver chooses for: the decoder's linears, grouped into units that must share
one scheme, and each unit's cost (stored bits) under each candidate.

vLLM fuses q/k/v into one qkv_proj and gate/up into one gate_up_proj, and runs a layer's experts
as one fused kernel: each of those needs one scheme. So a unit is a group of linears that read
one input (the family layout's `sequential` groups), except that all of a layer's experts form
one unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmq.config import QuantArgs, fit_group_size
from llmq.io.layout import DecoderLayout
from llmq.pack.sizes import stored_bytes


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

    def args(self, candidate: QuantArgs | None) -> QuantArgs | None:
        """The candidate as this linear takes it: a group size its width is not a multiple of
        becomes the largest one that divides it (as `quantize` does)."""
        return None if candidate is None else fit_group_size(candidate, self.columns)

    def bits(self, candidate: QuantArgs | None) -> int:
        return 8 * stored_bytes(self.args(candidate), self.rows, self.columns, self.dtype)


def choice_units(layout: DecoderLayout, prefix: str, linears: list[Linear]) -> list[list[Linear]]:
    """One layer's `linears` (`layout` is that layer's; names under `prefix`) in units that
    share a scheme, in execution order."""
    unit_of: dict[str, int] = {}
    for index, group in enumerate(layout.sequential):
        for name in group:
            unit_of[name] = index
    experts = layout.experts
    units: dict[object, list[Linear]] = {}
    for linear in linears:
        local = linear.name[len(prefix) :]
        key: object = unit_of[local]
        if experts is not None and local.startswith(f"{experts.module}."):
            key = "experts"
        units.setdefault(key, []).append(linear)
    return list(units.values())
