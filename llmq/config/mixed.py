"""Mixed precision to a budget (`quantize --target-bits` / `--max-size`): which schemes each
linear may take, how its damage under each is measured, and the budget the choice must fit.

A candidate is a weight-only scheme written by name: `int4-g128` (4-bit symmetric integer codes,
a scale per 128 inputs), `int8` (8-bit, a scale per output channel), `fp8`, `nvfp4a16`,
`mxfp4a16`, `mxfp8a16` (those formats' weights), `dense` (the linear kept at its stored dtype).
Each config group is written in its own compressed-tensors format (the checkpoint's format
`mixed-precision` when they differ), so one checkpoint holds any mix that transformers and vLLM
load. A GGUF export's candidates are GGUF types (`q4_k`, `q6_k`, `q8_0`, `f16`, ...),
each tensor its own (llama.cpp reads a type per tensor); `llmq.gguf.budget` checks their names.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmq.config.quant import QuantArgs, get_scheme, is_valid_group_size
from llmq.errors import InputError
from llmq.texts import DEFAULT_EVAL_TEXT

DENSE = "dense"
DEFAULT_CANDIDATES = ("int4-g128", "int4-g64", "int4-g32", "int8", DENSE)
DEFAULT_GGUF_CANDIDATES = ("q4_k", "q5_k", "q6_k", "q8_0")
# weight-only float candidates: each the weights of the scheme it is named after (FP8 per channel)
FLOAT_CANDIDATES = {
    "fp8": "fp8",
    "nvfp4a16": "nvfp4a16",
    "mxfp4a16": "mxfp4a16",
    "mxfp8a16": "mxfp8",
}
CANDIDATE_RULE = (
    "int4-gN or int8-gN (N a power of two >= 16), int4 or int8 (per channel), fp8, nvfp4a16, "
    "mxfp4a16, mxfp8a16, dense"
)
# auto: gradient for a dense model, output for a mixture of experts;
# output: each linear's output error on the calibration activations (its inputs' Hessian);
# residual: that error over the mean square of the residual stream entering its layer;
# gradient: the output error weighted per output channel by the loss's squared gradients there;
# fisher: the language-model loss's diagonal Fisher on a few windows;
# weight: the weights' own squared error (data-free)
Sensitivity = Literal["auto", "output", "residual", "gradient", "fisher", "weight"]


def candidate_args(name: str) -> QuantArgs | None:
    """The weight arguments a candidate names (None: dense); InputError for anything else."""
    if name == DENSE:
        return None
    if name in FLOAT_CANDIDATES:
        return get_scheme(FLOAT_CANDIDATES[name]).weights
    found = re.fullmatch(r"int(4|8)(?:-g(\d+))?", name)
    group = int(found.group(2)) if found and found.group(2) else None
    if not found or (group is not None and not is_valid_group_size(group)):
        raise InputError(f"--candidates: {name!r} is not a candidate", hint=f"write {CANDIDATE_RULE}")  # fmt: skip
    bits = int(found.group(1))
    if group is None:
        return QuantArgs(num_bits=bits, strategy="channel")  # type: ignore[arg-type]
    return QuantArgs(num_bits=bits, strategy="group", group_size=group)  # type: ignore[arg-type]


class MixedConfig(BaseModel):
    """The budget (average stored bits per decoder-linear weight, or the written weights'
    bytes), the candidates each linear chooses from, and how damage is measured."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    target_bits: float | None = Field(None, gt=0.0, le=32.0)
    max_size: int | None = Field(None, gt=0)  # bytes of every tensor written
    candidates: tuple[str, ...] | None = None  # None: the format's default (DEFAULT_*CANDIDATES)
    sensitivity: Sensitivity = "auto"
    fisher_windows: int = Field(8, ge=1, le=1024)  # calibration windows the Fisher reads
    # A perplexity gate on held-out text: while the increase over the source exceeds it, the
    # budget rises by `step_bits` and the model is quantized again (target_bits only).
    max_ppl_increase: float | None = Field(None, ge=0.0, lt=100.0)
    eval_text: str = DEFAULT_EVAL_TEXT
    eval_windows: int = Field(40, ge=1, le=100_000)
    step_bits: float = Field(0.25, gt=0.0, le=16.0)

    @field_validator("candidates")
    @classmethod
    def _distinct(cls, names: tuple[str, ...] | None) -> tuple[str, ...] | None:
        """Two or more, each once; which names a format takes is its own check (compressed-
        tensors': `candidate_args`, in the recipe's check; GGUF's: its type names)."""
        if names is None:
            return None
        if len(set(names)) != len(names):
            raise ValueError("--candidates: a candidate is named twice")
        if len(names) < 2:
            raise ValueError("--candidates: give at least two to choose from")
        return names

    @model_validator(mode="after")
    def _one_budget(self) -> MixedConfig:
        if (self.target_bits is None) == (self.max_size is None):
            raise ValueError("give one budget: --target-bits or --max-size")
        if self.max_ppl_increase is not None and self.max_size is not None:
            raise ValueError("max_ppl_increase: raises a --target-bits budget; --max-size is a limit")  # fmt: skip
        return self
