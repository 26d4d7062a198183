"""Validated configuration: what to quantize and how. No torch here (configs say what, not how).

Field names are compressed-tensors' (`num_bits`, `strategy`, `group_size`, `symmetric`,
`dynamic`, `ignore`) so that what a user types, what Python builds and what lands in
config.json read the same.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmq.errors import InputError

Strategy = Literal["tensor", "channel", "group", "token"]


class QuantArgs(BaseModel):
    """How one tensor is quantized (a subset of compressed-tensors' QuantizationArgs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_bits: Literal[4, 8]
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    strategy: Strategy
    group_size: int | None = None
    dynamic: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> QuantArgs:
        if self.strategy == "group":
            if self.group_size is None or not is_valid_group_size(self.group_size):
                raise ValueError(f"group_size {self.group_size} is not a power of two >= 16")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only used with strategy 'group', not {self.strategy}")
        if self.type == "float" and (self.num_bits != 8 or not self.symmetric):
            raise ValueError("float quantization is FP8 E4M3: num_bits 8, symmetric")
        return self

    @property
    def label(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.num_bits}"
        side = "" if self.symmetric else " asym"
        detail = f"g{self.group_size}" if self.strategy == "group" else self.strategy
        return f"{kind} {detail}{side}"


def is_valid_group_size(group_size: int) -> bool:
    """Group sizes llmq accepts: powers of two from 16 (kernels and packing need them)."""
    return group_size >= 16 and group_size & (group_size - 1) == 0


def fit_group_size(args: QuantArgs, in_features: int) -> QuantArgs:
    """`args` for a linear whose in_features the group size does not divide: the largest
    power-of-two divisor of in_features, else per-channel (what `quantize` does, and reports)."""
    if args.strategy != "group" or in_features % int(args.group_size or 0) == 0:
        return args
    divisor = in_features & -in_features
    if is_valid_group_size(divisor):
        return args.model_copy(update={"group_size": divisor})
    return args.model_copy(update={"strategy": "channel", "group_size": None})


class Scheme(BaseModel):
    """A preset: weight arguments, optional input-activation arguments, and the on-disk format."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    weights: QuantArgs
    input_activations: QuantArgs | None = None

    @property
    def format(self) -> str:
        """compressed-tensors' CompressionFormat value for this scheme."""
        if self.weights.type == "float":
            return "float-quantized"
        if self.input_activations is not None:
            return "int-quantized"
        return "pack-quantized"


_TOKEN_INT8 = QuantArgs(num_bits=8, strategy="token", dynamic=True)
_TOKEN_FP8 = QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True)

SCHEMES: dict[str, Scheme] = {
    scheme.name: scheme
    for scheme in (
        Scheme(name="W4A16", weights=QuantArgs(num_bits=4, strategy="group", group_size=128)),
        Scheme(
            name="W4A16_ASYM",
            weights=QuantArgs(num_bits=4, strategy="group", group_size=128, symmetric=False),
        ),
        Scheme(name="W8A16", weights=QuantArgs(num_bits=8, strategy="channel")),
        Scheme(
            name="W8A8",
            weights=QuantArgs(num_bits=8, strategy="channel"),
            input_activations=_TOKEN_INT8,
        ),
        Scheme(
            name="FP8_DYNAMIC",
            weights=QuantArgs(num_bits=8, type="float", strategy="channel"),
            input_activations=_TOKEN_FP8,
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


class CalibConfig(BaseModel):
    """Which calibration text, and how it is sampled (reproducibly, from `seed`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = "shakespeare+pydoc"
    num_samples: int = Field(128, ge=1, le=100_000)
    seq_len: int = Field(512, ge=8, le=131_072)
    seed: int = 0


class GPTQConfig(BaseModel):
    """GPTQ's knobs, with llm-compressor's names (arXiv 2210.17323)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(128, ge=16, le=4096)  # columns per lazy batch update
    dampening_frac: float = Field(0.01, gt=0.0, lt=1.0)  # of the Hessian's mean diagonal
    # static: columns in decreasing Hessian-diagonal order, groups fixed up front (no g_idx);
    # none: columns in order, each group's range taken from the updated weights.
    actorder: Literal["static", "none"] = "static"


class AWQConfig(BaseModel):
    """AWQ's scale search (arXiv 2306.00978): s = mean|x|^alpha over `grid` alphas in [0, 1]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grid: int = Field(20, ge=2, le=1000)
    # s = mean|x|^alpha / mean|w|^(1-alpha), as AutoAWQ and llm-compressor do by default; off:
    # the paper's s = mean|x|^alpha.
    duo_scaling: bool = True


class Recipe(BaseModel):
    """Everything `quantize` needs to reproduce a checkpoint; written into the output folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: Scheme
    method: str = "rtn"
    group_size: int | None = None  # override of the scheme's group size; -1 is per-channel
    strict_group_size: bool = False
    ignore: tuple[str, ...] = ("lm_head",)
    # Per-group range shrink: mse minimises the weight error, output the error of the linear's
    # output on the calibration data (needs calibration).
    clip: Literal["none", "mse", "output"] = "none"
    calibration: CalibConfig | None = None  # None: no forward passes, no per-layer error report
    gptq: GPTQConfig = GPTQConfig()
    awq: AWQConfig = AWQConfig()

    @model_validator(mode="after")
    def _group_size(self) -> Recipe:
        g = self.group_size
        if g is not None and g != -1 and not is_valid_group_size(g):
            raise ValueError(f"group_size {g} is not -1 or a power of two >= 16")
        if g is not None and g != -1 and self.scheme.weights.type == "float":
            raise ValueError("FP8 weights have no group size")
        return self

    @property
    def weight_args(self) -> QuantArgs:
        """The scheme's weight arguments after the --group-size override."""
        return with_group_size(self.scheme.weights, self.group_size)


def with_group_size(args: QuantArgs, group_size: int | None) -> QuantArgs:
    """`args` with a --group-size override: None keeps it, -1 is per-channel (validated)."""
    if group_size is None:
        return args
    if group_size != -1 and not is_valid_group_size(group_size):
        raise InputError(f"--group-size {group_size}: not -1 or a power of two >= 16")
    if args.type == "float":
        raise InputError(f"--group-size {group_size}: FP8 weights have no group size")
    if group_size == -1:
        return args.model_copy(update={"strategy": "channel", "group_size": None})
    return args.model_copy(update={"strategy": "group", "group_size": group_size})


def build(model_cls: type[BaseModel], /, **fields: object) -> BaseModel:
    """Build a config, turning pydantic's validation errors into one-line InputErrors."""
    try:
        return model_cls(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise InputError(f"{where + ': ' if where else ''}{message}") from None
