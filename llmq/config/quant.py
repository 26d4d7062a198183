"""Quantization arguments and the scheme presets (compressed-tensors' vocabulary).

Field names are compressed-tensors' (`num_bits`, `strategy`, `group_size`, `symmetric`,
`dynamic`, `ignore`) so that what a user types, what Python builds and what lands in
config.json read the same.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from llmq.errors import InputError

Strategy = Literal["tensor", "channel", "group", "block", "token"]


class QuantArgs(BaseModel):
    """How one tensor is quantized (a subset of compressed-tensors' QuantizationArgs)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    num_bits: Literal[4, 8]
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    strategy: Strategy
    group_size: int | None = None
    # strategy "block": [rows, columns] of the weight tiles sharing one scale (FP8 128x128)
    block_structure: tuple[int, int] | None = None
    dynamic: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> QuantArgs:
        if self.strategy == "group":
            if self.group_size is None or not is_valid_group_size(self.group_size):
                raise ValueError(f"group_size {self.group_size} is not a power of two >= 16")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only used with strategy 'group', not {self.strategy}")
        if (self.strategy == "block") != (self.block_structure is not None):
            raise ValueError("block_structure goes with strategy 'block', and only with it")
        if self.block_structure is not None and not all(
            is_valid_group_size(side) for side in self.block_structure
        ):
            raise ValueError(f"block_structure {self.block_structure}: powers of two >= 16")
        if self.block_structure is not None and not self.symmetric:
            raise ValueError("block scales are symmetric: a block has no zero point")
        if self.type == "float" and (self.num_bits != 8 or not self.symmetric):
            raise ValueError("float quantization is FP8 E4M3: num_bits 8, symmetric")
        return self

    @property
    def label(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.num_bits}"
        side = "" if self.symmetric else " asym"
        detail = self.strategy
        if self.strategy == "group":
            detail = f"g{self.group_size}"
        elif self.block_structure is not None:
            detail = "block {}x{}".format(*self.block_structure)
        return f"{kind} {detail}{side}"


def is_valid_group_size(group_size: int) -> bool:
    """Group sizes llmq accepts: powers of two from 16 (kernels and packing need them)."""
    return group_size >= 16 and group_size & (group_size - 1) == 0


GROUP_OVERRIDE_RULE = "-1 or a power of two >= 16"


def is_valid_group_override(group_size: int) -> bool:
    """A --group-size override (GROUP_OVERRIDE_RULE): -1 (per channel) or a valid group size."""
    return group_size == -1 or is_valid_group_size(group_size)


def fit_group_size(args: QuantArgs, in_features: int) -> QuantArgs:
    """`args` for a linear whose in_features the group size (or block width) does not divide:
    the largest power-of-two divisor of in_features, else per-channel (per-token for activations);
    what `quantize` does, and reports."""
    width = group_width(args)
    if width is None or in_features % width == 0:
        return args
    divisor = in_features & -in_features
    if is_valid_group_size(divisor):
        if args.strategy == "block":
            return args.model_copy(update={"block_structure": (args.block_structure[0], divisor)})  # type: ignore[index]
        return args.model_copy(update={"group_size": divisor})
    fallback = "token" if args.dynamic else "channel"
    return args.model_copy(
        update={"strategy": fallback, "group_size": None, "block_structure": None}
    )


def group_width(args: QuantArgs) -> int | None:
    """Columns sharing one scale along a row: the group size, a block's width, else None."""
    if args.strategy == "group":
        return args.group_size
    if args.strategy == "block" and args.block_structure is not None:
        return args.block_structure[1]
    return None


class Scheme(BaseModel):
    """A preset: weight arguments, optional input-activation arguments, and the on-disk format."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    weights: QuantArgs | None  # None: weights stay in their dtype (DENSE: pruning alone)
    input_activations: QuantArgs | None = None
    # the weight range search `quantize` uses unless told otherwise (the best measured for the
    # preset: benchmarks/RESULTS.md)
    default_clip: Literal["none", "mse", "output"] = "none"

    def clip_for(self, method: str) -> str:
        """The clip search `method` gets unless --clip says otherwise: the preset's, except that
        calibrated methods on int4 weights search the output error on the calibration data they
        already read. On the default model that halved GPTQ W4A16's increase in domain and took
        it below RTN's out of domain (benchmarks/RESULTS.md); int8 weights lose little to
        rounding and keep their range."""
        calibrated = method not in ("rtn", "magnitude")
        if self.weights is None:
            return "none"
        if self.default_clip == "none" and calibrated and self.weights.num_bits == 4:
            return "output"
        return self.default_clip

    @property
    def format(self) -> str:
        """compressed-tensors' CompressionFormat value for this scheme."""
        if self.weights is None:
            return "dense"
        if self.weights.type == "float":
            return "float-quantized"
        if self.input_activations is not None:
            return "int-quantized"
        return "pack-quantized"


_TOKEN_INT8 = QuantArgs(num_bits=8, strategy="token", dynamic=True)
_TOKEN_FP8 = QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True)
FP8_BLOCK_SIZE = 128  # DeepSeek-V3's 128x128 weight tiles and 1x128 activation groups

SCHEMES: dict[str, Scheme] = {
    scheme.name: scheme
    for scheme in (
        Scheme(name="W4A16", weights=QuantArgs(num_bits=4, strategy="group", group_size=128)),
        Scheme(
            name="W4A16_ASYM",
            weights=QuantArgs(num_bits=4, strategy="group", group_size=128, symmetric=False),
        ),
        Scheme(name="W8A16", weights=QuantArgs(num_bits=8, strategy="channel")),
        Scheme(name="DENSE", weights=None),  # `llmq prune`: pruned weights, not quantized
        Scheme(
            name="W8A8",
            weights=QuantArgs(num_bits=8, strategy="channel"),
            input_activations=_TOKEN_INT8,
        ),
        Scheme(
            name="FP8_DYNAMIC",
            weights=QuantArgs(num_bits=8, type="float", strategy="channel"),
            input_activations=_TOKEN_FP8,
            default_clip="mse",  # beat no clipping and SmoothQuant on both held-out texts
        ),
        Scheme(
            name="FP8_TENSOR",
            weights=QuantArgs(num_bits=8, type="float", strategy="tensor"),
            input_activations=_TOKEN_FP8,
        ),
        Scheme(
            name="FP8_BLOCK",
            weights=QuantArgs(
                num_bits=8,
                type="float",
                strategy="block",
                block_structure=(FP8_BLOCK_SIZE, FP8_BLOCK_SIZE),
            ),
            input_activations=QuantArgs(
                num_bits=8, type="float", strategy="group", group_size=FP8_BLOCK_SIZE, dynamic=True
            ),
        ),
    )
}
SCHEME_ALIASES = {"fp8": "FP8_DYNAMIC"}


def scheme_names() -> list[str]:
    """CLI spellings: lower-case aliases of the preset names."""
    return [name.lower().replace("_", "-") for name in SCHEMES] + list(SCHEME_ALIASES)


def get_scheme(name: str) -> Scheme:
    key = SCHEME_ALIASES.get(name.lower(), name.upper().replace("-", "_"))
    try:
        return SCHEMES[key]
    except KeyError:
        raise InputError(
            f"unknown scheme {name!r}", hint=f"choose one of: {', '.join(scheme_names())}"
        ) from None


# fallback-scan's defaults (shared by the scan, the API and the CLI)
SCAN_SCHEME = "int8-tensor"
SCAN_RATIO_THRESHOLD = 60.0
"""(max - min) / IQR is about 8-10 for a Gaussian tensor of a few million values."""
SCAN_SHARE_THRESHOLD = 0.05
"""With calibration statistics: flag a linear that causes over 5% of the estimated output error
of all the scanned linears together (the average share is 1 / their number)."""


def nm_pattern(pattern: str | None) -> tuple[int, int] | None:
    """An "N:M" sparsity pattern as (n, m), checked: at most N non-zeros in every M."""
    if pattern is None:
        return None
    n, m = (int(part) for part in pattern.split(":"))
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern}: N:M needs 0 < N < M")
    return n, m
