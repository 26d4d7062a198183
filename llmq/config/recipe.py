"""What `quantize` and `prune` do: calibration, method knobs and the Recipe that gathers them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmq.config.mixed import MixedConfig, candidate_args
from llmq.config.quant import (
    GROUP_OVERRIDE_RULE,
    QuantArgs,
    Scheme,
    is_valid_group_override,
    nm_pattern,
)
from llmq.errors import InputError
from llmq.texts import DEFAULT_CALIBRATION_TEXT

DEFAULT_CALIB_SAMPLES = 128  # calibration windows of a method that needs data
# Windows plain RTN takes by default: it needs no data, so they only feed the per-layer
# output-error report.
DEFAULT_REPORT_SAMPLES = 1
QUANTIZE_METHODS = ("rtn", "gptq", "awq", "awq+gptq")  # llmq.quant.methods registers each
PRUNING_METHODS = ("magnitude", "wanda", "sparsegpt")


class CalibConfig(BaseModel):
    """Which calibration text, and how it is sampled (reproducibly, from `seed`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    text: str = DEFAULT_CALIBRATION_TEXT
    num_samples: int = Field(DEFAULT_CALIB_SAMPLES, ge=1, le=100_000)
    seq_len: int = Field(512, ge=8, le=131_072)
    seed: int = 0
    # A mixture of experts: every token through every expert for the statistics (the output
    # keeps the model's routing), or each expert on the tokens routed to it.
    moe_calibration: Literal["all", "routed"] = "all"


class GPTQConfig(BaseModel):
    """GPTQ's knobs, with llm-compressor's names (arXiv 2210.17323)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    block_size: int = Field(128, ge=16, le=4096)  # columns per lazy batch update
    dampening_frac: float = Field(0.01, gt=0.0, lt=1.0)  # of the Hessian's mean diagonal
    # static: columns in decreasing Hessian-diagonal order, groups fixed up front (no g_idx);
    # none: columns in order, each group's range taken from the updated weights.
    actorder: Literal["static", "none"] = "static"
    # Inside a layer, quantize q/k/v, then o_proj, gate/up, down_proj, each group observed after
    # the groups before it are quantized (one forward pass a layer, more activations held);
    # off: observe the full-precision layer whole, then run it again quantized (two passes).
    # Also governs RTN with clip="output", the other method that needs only its Hessians.
    true_sequential: bool = True


class AWQConfig(BaseModel):
    """AWQ's scale search (arXiv 2306.00978): s = mean|x|^alpha over `grid` alphas in [0, 1]."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    grid: int = Field(20, ge=2, le=1000)
    # s = mean|x|^alpha / mean|w|^(1-alpha), as AutoAWQ and llm-compressor do by default; off:
    # the paper's s = mean|x|^alpha.
    duo_scaling: bool = True


class Recipe(BaseModel):
    """Everything `quantize` needs to reproduce a checkpoint; written into the output folder."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

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
    # SmoothQuant's migration strength alpha in [0, 1], "auto" (searched per norm/linear on the
    # calibration data), or None (off)
    smooth: float | Literal["auto"] | None = None
    # Input activation scales: per token at run time (dynamic), or one calibrated scale per
    # linear (static, stored as input_scale), chosen by `observer`.
    activations: Literal["dynamic", "static"] = "dynamic"
    observer: Literal["absmax", "percentile", "mse"] = "absmax"
    kv_cache: Literal["fp8", "int8"] | None = None  # calibrated per-tensor k/v scales
    # Pruning methods (magnitude, wanda, sparsegpt): the share of each row's weights removed, or
    # an N:M pattern ("2:4": at most 2 non-zeros in every 4 consecutive inputs)
    sparsity: float | None = Field(None, gt=0.0, lt=1.0)
    pattern: str | None = Field(None, pattern=r"^\d+:\d+$")
    # How `sparsity` is spread over the decoder layers: the same everywhere, by OWL's outlier
    # ratios, or by the layers' shares of the pruning error (llmq.pruning.profile), both
    # measured on the dense model first
    sparsity_profile: Literal["uniform", "owl", "scan"] = "uniform"
    # Model-free conversion: the module patterns quantized (`--ignore`'s syntax); empty: the
    # family layout's decoder linears, or every linear-looking 2-D weight of an unknown family
    targets: tuple[str, ...] = ()
    # Mixed precision to a budget: each linear's scheme chosen from candidates (llmq.mixed);
    # None: the scheme's weights everywhere
    mixed: MixedConfig | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        g = self.group_size
        if g is not None and not is_valid_group_override(g):
            raise ValueError(f"group_size {g} is not {GROUP_OVERRIDE_RULE}")
        weights = self.scheme.weights
        if g is not None and weights is None:
            raise ValueError("pruned weights have no group size")
        if g is not None and weights is not None and weights.type == "float":
            raise ValueError(f"group_size {g}: {weights.label} weights: {_NO_GROUP}")
        _check_activation_options(self)
        if self.clip != "none" and (weights is None or weights.strategy == "block"):
            raise ValueError(f"clip {self.clip}: not available for block-scaled weights")
        if self.calibration is None and self.needs_calibration:
            raise ValueError(
                "static activation scales, NVFP4's input global scales, --smooth and --kv-cache "
                "need calibration"
            )
        _check_pruning(self)
        _check_mixed(self)
        routed = self.calibration is not None and self.calibration.moe_calibration == "routed"
        if routed and (self.method.startswith("awq") or self.smooth is not None):
            raise ValueError(
                "moe_calibration routed: AWQ and SmoothQuant scale all experts from one input "
                "norm, which needs every expert's statistics on every token; use all"
            )
        return self

    @property
    def nm_pattern(self) -> tuple[int, int] | None:
        """The N:M pattern as (n, m)."""
        return nm_pattern(self.pattern)

    @property
    def weight_args(self) -> QuantArgs | None:
        """The scheme's weight arguments after the --group-size override (None: not quantized)."""
        if self.scheme.weights is None:
            return None
        return with_group_size(self.scheme.weights, self.group_size)

    @property
    def activation_args(self) -> QuantArgs | None:
        """The scheme's input activation arguments; static: one per-tensor scale per linear."""
        args = self.scheme.input_activations
        if args is None or self.activations == "dynamic":
            return args
        return args.model_copy(update={"strategy": "tensor", "dynamic": False})

    @property
    def kv_cache_args(self) -> QuantArgs | None:
        """compressed-tensors' kv_cache_scheme: one static scale per layer for keys, one for values."""
        if self.kv_cache is None:
            return None
        kind = "float" if self.kv_cache == "fp8" else "int"
        return QuantArgs(num_bits=8, type=kind, strategy="tensor")

    @property
    def needs_calibration(self) -> bool:
        global_scale = self.activation_args is not None and self.activation_args.dynamic == "local"
        return (
            self.smooth is not None
            or self.activations == "static"
            or self.kv_cache is not None
            or global_scale
        )


SMOOTH_ALPHA = 0.5  # SmoothQuant's default migration strength (the paper's)
# Seconds between the resume points of `quantize`. A resume point holds the hidden states after
# a layer, as large as the calibration activations (151 MB for the default model at 128 x 512
# tokens, 2 GB for a 70B one): saved after every layer, they cost 2-3% of a W8A8 run here. A
# minute of work is what an interruption can lose instead.
RESUME_EVERY_S = 60.0
# A task-accuracy gate fails only on a drop significant at this level (one-sided, paired).
DEFAULT_CONFIDENCE = 0.95


def parse_smooth(value: str | float | None) -> float | Literal["auto"] | None:
    """--smooth: none, auto, or alpha in [0, 1] (InputError otherwise)."""
    if value is None or str(value).lower() == "none":
        return None
    if str(value).lower() == "auto":
        return "auto"
    try:
        alpha = float(value)
    except ValueError:
        raise InputError(f"--smooth {value}: expected alpha in [0, 1], auto or none") from None
    if not 0.0 <= alpha <= 1.0:
        raise InputError(
            f"--smooth {value}: alpha must be in [0, 1]",
            hint="0 leaves activations alone, 1 moves all their range into the weights",
        )
    return alpha


def _check_pruning(recipe: Recipe) -> None:
    """A pruning method takes exactly one of sparsity and pattern; other methods neither."""
    given = [f for f, v in (("sparsity", recipe.sparsity), ("pattern", recipe.pattern)) if v is not None]  # fmt: skip
    if recipe.method not in PRUNING_METHODS:
        if given or recipe.sparsity_profile != "uniform":
            raise ValueError(
                f"{(given or ['sparsity_profile'])[0]}: prunes only with method {', '.join(PRUNING_METHODS)}"
            )
        if recipe.scheme.weights is None:
            raise ValueError(f"method {recipe.method} quantizes: pruning alone takes a pruner")
        return
    if len(given) != 1:
        raise ValueError(f"method {recipe.method}: give either sparsity or pattern (not both)")
    nm_pattern(recipe.pattern)  # 0 < N < M
    if recipe.sparsity_profile != "uniform":
        if recipe.sparsity is None:
            raise ValueError("sparsity_profile: spreads a --sparsity; an N:M pattern is per group")
        if recipe.calibration is None:
            raise ValueError(
                f"sparsity_profile {recipe.sparsity_profile}: measures the dense model on calibration data"
            )


def _check_mixed(recipe: Recipe) -> None:
    """Mixed precision chooses among weight-only integer candidates, per linear, by measured
    damage: a scheme that quantizes activations, a group-size override or a pruner has no
    place in it, and the damage it reads must have its data."""
    mixed = recipe.mixed
    if mixed is None:
        return
    if recipe.method in PRUNING_METHODS:
        raise ValueError(f"target bits: method {recipe.method} prunes; mixed precision quantizes")
    weights = recipe.scheme.weights
    if recipe.scheme.input_activations is not None or weights is None or weights.type != "int":
        raise ValueError(
            f"target bits: the candidates are weight-only integer schemes; scheme "
            f"{recipe.scheme.name.lower()} is not one (use w4a16 or w8a16)"
        )
    if recipe.group_size is not None:
        raise ValueError("group_size: each candidate names its own (int4-g64, ...)")
    for name in mixed.candidates or ():
        candidate_args(name)  # InputError for a name compressed-tensors' candidates lack
    if mixed.sensitivity != "weight" and recipe.calibration is None:
        raise ValueError(f"sensitivity {mixed.sensitivity}: measured on calibration data")


def _check_activation_options(recipe: Recipe) -> None:
    activations = recipe.scheme.input_activations
    name = recipe.scheme.name.lower().replace("_", "-")
    if recipe.smooth is not None:
        if activations is None:
            raise ValueError(
                f"smooth: {name} leaves activations in full precision; SmoothQuant is for "
                "schemes that quantize them (w8a8, fp8, fp8-tensor, fp8-block)"
            )
        if recipe.method.startswith("awq"):
            raise ValueError(f"smooth: {recipe.method} folds its own scales; use rtn or gptq")
    if recipe.activations == "static":
        if activations is None:
            raise ValueError(f"activations static: {name} does not quantize activations")
        if activations.strategy in ("group", "tensor_group"):
            raise ValueError(f"activations static: {name} activations are per-token-group dynamic")
    elif recipe.observer != "absmax":
        raise ValueError(f"observer {recipe.observer}: observers choose static scales")


_NO_GROUP = "the format fixes the group size (FP8: none; NVFP4: 16; MX: 32)"


def with_group_size(args: QuantArgs, group_size: int | None) -> QuantArgs:
    """`args` with a --group-size override: None keeps it, -1 is per-channel (validated)."""
    if group_size is None:
        return args
    if not is_valid_group_override(group_size):
        raise InputError(f"--group-size {group_size}: not {GROUP_OVERRIDE_RULE}")
    if args.type == "float":
        raise InputError(f"--group-size {group_size}: {args.label} weights: {_NO_GROUP}")
    if group_size == -1:
        return args.model_copy(update={"strategy": "channel", "group_size": None})
    return args.model_copy(update={"strategy": "group", "group_size": group_size})


class GGUFRecipe(BaseModel):
    """A GGUF export (`quantize --format gguf`): llama.cpp's file type, per-tensor type overrides
    and where the importance matrix comes from (a file, the calibration text, or nowhere)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    scheme: str = "q4_k_m"
    # rtn: each weight's nearest code on the searched grid; gptq: codes with GPTQ's error
    # feedback on that grid (needs the calibration pass's Hessians)
    method: Literal["rtn", "gptq"] = "rtn"
    tensor_types: tuple[str, ...] = ()  # PATTERN=TYPE over GGUF tensor names, first match wins
    imatrix: str | None = None  # an importance-matrix file (llmq's or llama.cpp's)
    # the imatrix from this text when no file is given, and the mixed choice's sensitivity
    calibration: CalibConfig | None = None
    # Per-tensor GGUF types under a --target-bits budget (llmq.gguf.budget); None: the scheme's mix
    mixed: MixedConfig | None = None

    @model_validator(mode="after")
    def _budget(self) -> GGUFRecipe:
        mixed = self.mixed
        if mixed is None:
            return self
        if mixed.max_ppl_increase is not None:
            raise ValueError("max_ppl_increase: gates compressed-tensors checkpoints, not GGUF files")  # fmt: skip
        if mixed.sensitivity != "weight" and self.calibration is None:
            raise ValueError(f"sensitivity {mixed.sensitivity}: measured on calibration data")
        return self


def build(model_cls: type[BaseModel], /, **fields: object) -> BaseModel:
    """Build a config, turning pydantic's validation errors into one-line InputErrors."""
    try:
        return model_cls(**fields)
    except ValidationError as exc:
        raise one_line(exc, model_cls) from None


def one_line(exc: ValidationError, model_cls: type[BaseModel]) -> InputError:
    """The first of pydantic's errors as one line naming the field (an unknown one with the
    fields there are)."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":  # the fields to choose from, where they are ours
        top = len(first["loc"]) == 1
        message = f"unknown option (choose from: {', '.join(model_cls.model_fields)})" if top else "unknown option"  # fmt: skip
    return InputError(f"{where + ': ' if where else ''}{message}")
