"""GGUF types to a budget (`quantize --format gguf --target-bits B` or `--max-size SIZE`): each
decoder tensor's type chosen from `--candidates` (default q4_k, q5_k, q6_k, q8_0) for the least
measured damage whose bytes fit B bits a weight (or whose file's tensors fit SIZE bytes), by
mixed precision's own solver (`llmq.mixed`).

llama.cpp reads a type per tensor, so every decoder linear is its own unit (a mixture's experts
of one role are one stacked tensor: one unit). The budget covers the decoder's quantized
tensors: those `--tensor-type` pins and those that are no plain linear of the checkpoint
(DeepSeek's split kv_b) keep their type and count against it. The embedding and output keep
the scheme's types, outside the budget, as llama.cpp's `--target-bpw` leaves them.

Each candidate's damage comes from the weight as that type stores it: the same scale search,
with the calibration inputs' mean squares as importance, that the export then runs.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import torch
from torch import Tensor

from llmq.calib.stats import ACCUM_DTYPE
from llmq.config import MixedConfig
from llmq.config.mixed import DEFAULT_GGUF_CANDIDATES
from llmq.errors import InputError
from llmq.gguf.export import PlannedTensor, quantized, type_bytes
from llmq.gguf.mix import FLOAT_TYPES, fitting_type, tensor_type
from llmq.io.checkpoint import Checkpoint, torch_dtype
from llmq.mixed.choose import Budget, checked_budget
from llmq.mixed.units import Linear

_Q = gguf.GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class TypeCandidate:
    """A GGUF type a tensor may take (the nearest llama.cpp falls back to, where its rows are
    not whole blocks of it)."""

    name: str
    qtype: gguf.GGMLQuantizationType

    def fitted(self, linear: Linear) -> gguf.GGMLQuantizationType:
        return fitting_type(self.qtype, linear.columns)

    def bits(self, linear: Linear) -> int:
        return 8 * type_bytes(self.fitted(linear), (linear.rows, linear.columns))

    def stored_as(self, linear: Linear) -> str:
        return self.fitted(linear).name

    def rounded(self, weight: Tensor, linear: Linear, importance: Tensor | None) -> Tensor | None:
        qtype = self.fitted(linear)
        if qtype == _Q.F32:
            return None  # 16- and 32-bit sources stored exactly
        if qtype == _Q.F16:
            return weight.half().to(ACCUM_DTYPE)
        values = weight.detach().float().cpu().numpy()
        weights_importance = None if importance is None else importance.float().cpu().numpy()
        decoded, _ = quantized(qtype, values, weights_importance)
        return torch.from_numpy(decoded).to(dtype=ACCUM_DTYPE, device=weight.device)


def type_candidates(names: tuple[str, ...]) -> list[TypeCandidate]:
    """The candidates GGUF type names name; InputError for anything else."""
    candidates = []
    for name in names:
        try:
            candidates.append(TypeCandidate(name, tensor_type(name)))
        except InputError as exc:
            raise InputError(f"--candidates: {name!r} is not a GGUF type llmq writes", hint=exc.hint) from None  # fmt: skip
    return candidates


@dataclass(frozen=True, slots=True)
class TypeBudget:
    budget: Budget
    types: list[TypeCandidate]  # budget.candidates, as GGUF types
    tensors: list[str]  # the GGUF tensor each of budget.units is
    counted: list[PlannedTensor]  # every tensor the budget covers, chosen or kept


def plan_type_budget(
    ckpt: Checkpoint,
    plan: list[PlannedTensor],
    config: MixedConfig,
    pinned: tuple[tuple[str, Any], ...],
) -> TypeBudget:
    """The budget over `plan`'s quantized decoder tensors: each plain linear's (or stacked
    experts') type to choose, unless a `pinned` (--tensor-type) pattern names it; `--max-size`
    counts every tensor the file holds, the others at their planned types. InputError when the
    cheapest candidates do not fit."""
    names = config.candidates or DEFAULT_GGUF_CANDIDATES
    config = config.model_copy(update={"candidates": names})
    candidates = type_candidates(names)
    linears = {
        f"{name}.weight" for index in range(ckpt.num_layers) for name in ckpt.layout.linear_names(index)
    }  # fmt: skip
    units, tensors, counted = [], [], []
    kept_bits = weights = 0
    for tensor in plan:
        if not tensor.name.startswith("blk.") or tensor.qtype in FLOAT_TYPES.values():
            continue
        counted.append(tensor)
        weights += math.prod(tensor.shape)
        chosen = tensor.part is None and set(tensor.sources) <= linears
        if not chosen or any(fnmatch.fnmatchcase(tensor.name, pattern) for pattern, _ in pinned):
            kept_bits += 8 * tensor.nbytes
            continue
        units.append([_linear(ckpt, source) for source in tensor.sources])
        tensors.append(tensor.name)
    if config.target_bits is not None:
        spend = math.floor(config.target_bits * weights) - kept_bits
    else:
        assert config.max_size is not None
        fixed = sum(tensor.nbytes for tensor in plan if tensor.name not in tensors)
        spend = 8 * (config.max_size - fixed)
    budget = Budget(config, units, list(candidates), spend, weights, kept_bits)
    return TypeBudget(checked_budget(budget), candidates, tensors, counted)


def _linear(ckpt: Checkpoint, source: str) -> Linear:
    info = ckpt.tensors[source]
    rows, columns = info.shape[-2:]
    return Linear(source.removesuffix(".weight"), rows, columns, torch_dtype(info.dtype))


def chosen_types(
    plan: TypeBudget, chosen: dict[str, tuple[Any, Linear]]
) -> tuple[tuple[str, gguf.GGMLQuantizationType], ...]:
    """The solver's choice as `--tensor-type` rules, one exact GGUF name each."""
    rules = []
    for name, unit in zip(plan.tensors, plan.budget.units, strict=True):
        candidate, _ = chosen[unit[0].name]
        rules.append((name, candidate.qtype))
    return tuple(rules)


def written_sizes(path: Path, plan: TypeBudget) -> dict[str, float]:
    """The bits a weight the budget's tensors take in the GGUF file at `path`, and the bytes of
    every tensor it holds (what --max-size bounds: the file less its header and alignment)."""
    covered = {tensor.name for tensor in plan.counted}
    tensors = gguf.GGUFReader(path).tensors
    stored = sum(int(t.n_bytes) for t in tensors if t.name in covered)
    return {"written_bits": 8 * stored / plan.budget.weights, "written_bytes": sum(int(t.n_bytes) for t in tensors)}  # fmt: skip
