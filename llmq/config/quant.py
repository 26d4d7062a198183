"""Quantization arguments and the scheme presets (compressed-tensors' vocabulary).

Field names are compressed-tensors' (`num_bits`, `strategy`, `group_size`, `symmetric`,
`dynamic`, `ignore`) so that what a user types, what Python builds and what lands in
config.json read the same.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from llmq.errors import InputError

Strategy = Literal["tensor", "channel", "group", "block", "token", "tensor_group"]
# Group scales stored in a type of their own (compressed-tensors' `scale_dtype`): FP8 E4M3 under a
# float32 per-tensor global scale (NVFP4, strategy "tensor_group"), or powers of two stored as
# E8M0 exponents in uint8 (the OCP MX formats, strategy "group" of 32).
ScaleDtype = Literal["float8_e4m3fn", "uint8"]
FLOAT_CODE_MAX = {4: 6.0, 8: 448.0}  # FP4 E2M1 and FP8 E4M3: the largest finite value
NVFP4_GROUP_SIZE, MX_GROUP_SIZE = 16, 32


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
    # "local": the group scales at run time under a calibrated global scale (NVFP4 inputs)
    dynamic: bool | Literal["local"] = False
    scale_dtype: ScaleDtype | None = None  # None: the weight's own floating-point dtype

    @field_validator("scale_dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: object) -> object:
        """compressed-tensors writes torch dtypes as "torch.uint8"."""
        return value.removeprefix("torch.") if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> QuantArgs:
        if (self.type == "float" and self.num_bits == 4) or self.scale_dtype is not None:
            _check_microscaled(self)
        if self.strategy in ("group", "tensor_group"):
            if self.group_size is None or not is_valid_group_size(self.group_size):
                raise ValueError(f"group_size {self.group_size} is not a power of two >= 16")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only used with group strategies, not {self.strategy}")
        if (self.strategy == "block") != (self.block_structure is not None):
            raise ValueError("block_structure goes with strategy 'block', and only with it")
        if self.block_structure is not None and not all(
            is_valid_group_size(side) for side in self.block_structure
        ):
            raise ValueError(f"block_structure {self.block_structure}: powers of two >= 16")
        if self.block_structure is not None and not self.symmetric:
            raise ValueError("block scales are symmetric: a block has no zero point")
        if self.type == "float" and not self.symmetric:
            raise ValueError("float codes (FP8 E4M3, FP4 E2M1) are symmetric: no zero point")
        if (self.strategy == "tensor_group") != (self.scale_dtype == "float8_e4m3fn"):
            raise ValueError("strategy tensor_group goes with scale_dtype float8_e4m3fn (NVFP4)")
        if self.dynamic == "local" and self.strategy != "tensor_group":
            raise ValueError('dynamic "local" needs strategy tensor_group (a global scale)')
        return self

    @property
    def microscaled(self) -> bool:
        """Scales in a type of their own (NVFP4, MX): the group size is the format's."""
        return self.scale_dtype is not None

    @property
    def timing(self) -> str:
        """When an activation's scales are chosen: at run time, on calibration data, or both."""
        if self.dynamic == "local":
            return "dynamic, calibrated global scale"
        return "dynamic" if self.dynamic else "static"

    @property
    def label(self) -> str:
        if self.scale_dtype == "uint8":
            return f"mxfp{self.num_bits} g{self.group_size}"
        if self.strategy == "tensor_group":
            return f"nvfp4 g{self.group_size}"
        kind = f"fp{self.num_bits}" if self.type == "float" else f"int{self.num_bits}"
        side = "" if self.symmetric else " asym"
        detail = self.strategy
        if self.strategy == "group":
            detail = f"g{self.group_size}"
        elif self.block_structure is not None:
            detail = "block {}x{}".format(*self.block_structure)
        return f"{kind} {detail}{side}"


def _check_microscaled(args: QuantArgs) -> None:
    """FP4 and MX arguments are the formats' own: E2M1 codes only in groups with their scales
    in a type of their own, NVFP4 in groups of 16, MX (E2M1 or E4M3 codes) in groups of 32."""
    if args.type != "float" or args.strategy not in ("group", "tensor_group"):
        raise ValueError(
            "FP4 and MX scales: float codes in groups (strategy group or tensor_group)"
        )
    if args.scale_dtype is None:
        raise ValueError("FP4 codes need their group scales' scale_dtype (float8_e4m3fn or uint8)")
    size = NVFP4_GROUP_SIZE if args.scale_dtype == "float8_e4m3fn" else MX_GROUP_SIZE
    if args.group_size != size:
        raise ValueError(f"scale_dtype {args.scale_dtype}: groups of {size}, not {args.group_size}")
    if args.scale_dtype == "float8_e4m3fn" and args.num_bits != 4:
        raise ValueError("NVFP4 (tensor_group) codes are FP4: num_bits 4")


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
    if args.microscaled:
        raise InputError(
            f"{args.label}: in_features {in_features} is not a multiple of the format's groups "
            f"of {width}",
            hint="leave the linear in full precision with --ignore",
        )
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
    if args.strategy in ("group", "tensor_group"):
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
        if self.weights.strategy == "tensor_group":
            return "nvfp4-pack-quantized"
        if self.weights.scale_dtype == "uint8":
            return f"mxfp{self.weights.num_bits}-{'pack-' if self.weights.num_bits == 4 else ''}quantized"
        if self.weights.type == "float":
            return "float-quantized"
        if self.input_activations is not None:
            return "int-quantized"
        return "pack-quantized"


_TOKEN_INT8 = QuantArgs(num_bits=8, strategy="token", dynamic=True)
_TOKEN_FP8 = QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True)
FP8_BLOCK_SIZE = 128  # DeepSeek-V3's 128x128 weight tiles and 1x128 activation groups
# NVFP4: E2M1 codes, an E4M3 scale per 16 values under a float32 per-tensor global scale
_NVFP4 = QuantArgs(
    num_bits=4, type="float", strategy="tensor_group", group_size=NVFP4_GROUP_SIZE,
    scale_dtype="float8_e4m3fn",
)  # fmt: skip


def _mx(num_bits: int, *, dynamic: bool = False) -> QuantArgs:
    """OCP MX: E2M1 (4 bits) or E4M3 (8 bits) codes, a power-of-two scale per 32 values."""
    return QuantArgs(
        num_bits=num_bits, type="float", strategy="group", group_size=MX_GROUP_SIZE,
        scale_dtype="uint8", dynamic=dynamic,
    )  # fmt: skip


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
SCHEMES.update(
    (scheme.name, scheme)
    for scheme in (
        Scheme(name="NVFP4A16", weights=_NVFP4),
        Scheme(
            name="NVFP4",
            weights=_NVFP4,
            input_activations=_NVFP4.model_copy(update={"dynamic": "local"}),
        ),
        Scheme(name="MXFP4A16", weights=_mx(4)),
        Scheme(name="MXFP4", weights=_mx(4), input_activations=_mx(4, dynamic=True)),
        Scheme(name="MXFP8", weights=_mx(8), input_activations=_mx(8, dynamic=True)),
    )
)
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
