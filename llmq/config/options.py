"""The options of `quantize`, `prune` and `prune --structured`, each declared once, by its
command-line name (underscores for dashes).

The CLI's flags, a recipe file's stage and `llmq.quantize(**options)` all build these objects,
so the same job writes the same recipe into `llmq.json` whichever way it was asked for. Defaults
are stated here, or in the nested config a value ends up in (`GPTQConfig`, `CalibConfig`, ...)
and read from there. `QuantizeOptions.recipe()` is the one place the flat options become the
nested `Recipe` a checkpoint records.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from llmq.config.fraction import Fraction
from llmq.config.mixed import MixedConfig, Sensitivity
from llmq.config.quant import get_scheme
from llmq.config.recipe import (
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_REPORT_SAMPLES,
    PRUNING_METHODS,
    QUANTIZE_METHODS,
    AWQConfig,
    CalibConfig,
    GGUFRecipe,
    GPTQConfig,
    Recipe,
    build,
    parse_smooth,
)
from llmq.config.sizes import parse_size
from llmq.errors import InputError

DATA_FREE_METHODS = ("rtn", "magnitude")  # need no calibration data (windows feed the report)


def _text(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


# A file the user names, given as text or a Path (kept as text: recipes record it as written)
FilePath = Annotated[str, BeforeValidator(_text)]


def default(model: type[BaseModel], name: str) -> Any:
    """The default a config states for `name`: options that end up there read it from it."""
    return model.model_fields[name].default


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @classmethod
    def of(cls, **values: Any) -> Any:
        """Validated options; a bad value is one InputError naming the option."""
        return build(cls, **values)


class CalibrationOptions(_Options):
    """Which text calibrates, and how much of it."""

    calib_text: FilePath = default(CalibConfig, "text")
    num_samples: int | None = Field(None, ge=1)  # None: the method's (see `num_samples_for`)
    seq_len: int = default(CalibConfig, "seq_len")
    seed: int = default(CalibConfig, "seed")
    moe_calibration: Literal["all", "routed"] = default(CalibConfig, "moe_calibration")

    def calibration(self, num_samples: int) -> CalibConfig:
        return build(CalibConfig, text=self.calib_text, num_samples=num_samples, seq_len=self.seq_len, seed=self.seed, moe_calibration=self.moe_calibration)  # fmt: skip


class LayerOptions(CalibrationOptions):
    """What the layer pipeline takes from the user, whether it prunes or quantizes."""

    ignore: tuple[str, ...] = ()  # lm_head is always kept besides these
    skip_layer_check: bool = False
    calib_stats: FilePath | None = None  # a statistics file from `llmq calibrate`
    dampening_frac: Fraction = default(GPTQConfig, "dampening_frac")
    block_size: int = default(GPTQConfig, "block_size")
    true_sequential: bool = default(GPTQConfig, "true_sequential")
    sparsity: Fraction | None = default(Recipe, "sparsity")
    pattern: str | None = default(Recipe, "pattern")
    sparsity_profile: Literal["uniform", "owl", "scan"] = default(Recipe, "sparsity_profile")


class PruneOptions(LayerOptions):
    """`llmq prune` without --structured: a pruner, alone; the checkpoint stays dense."""

    method: str = "sparsegpt"
    sparse_format: str = "dense"

    @classmethod
    def of(cls, **values: Any) -> Any:
        quantizing = sorted(set(values) & set(QuantizeOptions.model_fields) - set(cls.model_fields))
        if quantizing:
            method = values.get("method", default(cls, "method"))
            raise InputError(f"{quantizing[0]}: prune quantizes nothing", hint=f"use quantize --method {method} to prune and quantize in one pass")  # fmt: skip
        return super().of(**values)

    def recipe(self) -> Recipe:
        if self.method not in PRUNING_METHODS:
            raise InputError(f"unknown method {self.method!r} for prune", hint=f"choose one of: {', '.join(PRUNING_METHODS)}")  # fmt: skip
        check_sparse_format(self.sparse_format)
        return _recipe(self, scheme="dense", actorder="none", clip="none")


class QuantizeOptions(LayerOptions):
    """`llmq quantize`: a scheme and a method (a pruner too, to prune and quantize at once)."""

    scheme: str = "w4a16"
    method: str = default(Recipe, "method")
    group_size: int | None = default(Recipe, "group_size")
    strict_group_size: bool = default(Recipe, "strict_group_size")
    clip: Literal["none", "mse", "output"] | None = None  # None: the scheme's for the method
    actorder: str = default(GPTQConfig, "actorder")
    awq_grid: int = default(AWQConfig, "grid")
    awq_duo_scaling: bool = default(AWQConfig, "duo_scaling")
    smooth: str | float | None = None  # alpha, auto or none
    activations: Literal["dynamic", "static"] = default(Recipe, "activations")
    observer: Literal["absmax", "percentile", "mse"] = default(Recipe, "observer")
    kv_cache: Literal["fp8", "int8", "none"] | None = None
    fallback: FilePath | None = None  # a fallback-scan report, or auto
    fallback_threshold: Fraction | None = None
    require_loaders: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()  # model-free conversion: the weights quantized
    format: Literal["compressed-tensors", "gguf"] = "compressed-tensors"
    tensor_type: tuple[str, ...] = ()  # gguf: PATTERN=TYPE overrides
    imatrix: FilePath | None = None  # gguf: an importance-matrix file, or "none" (data-free)
    target_bits: float | None = default(MixedConfig, "target_bits")  # mixed precision's budget
    max_size: str | int | None = None  # ... or the written weights' size: "2GiB", bytes
    candidates: tuple[str, ...] | None = default(MixedConfig, "candidates")
    sensitivity: Sensitivity = default(MixedConfig, "sensitivity")
    fisher_windows: int = Field(default(MixedConfig, "fisher_windows"), ge=1, le=1024)
    max_ppl_increase: Fraction | None = default(MixedConfig, "max_ppl_increase")
    eval_text: str = default(MixedConfig, "eval_text")
    eval_windows: int = Field(default(MixedConfig, "eval_windows"), ge=1)
    step_bits: float = Field(default(MixedConfig, "step_bits"), gt=0.0, le=16.0)

    def recipe(self) -> Recipe:
        if self.format == "gguf":
            raise InputError("--format gguf writes a GGUF file, not a compressed-tensors recipe")
        stray = self._changed(GGUF_ONLY)
        if stray:
            raise InputError(f"--{stray[0].replace('_', '-')}: for --format gguf")
        methods = (*QUANTIZE_METHODS, *PRUNING_METHODS)
        if self.method not in methods:  # first: the other checks read the method
            raise InputError(f"unknown method {self.method!r}", hint=f"choose one of: {', '.join(sorted(methods))}")  # fmt: skip
        if self.actorder in ("group", "dynamic"):
            raise InputError(
                f"--actorder {self.actorder}: compressed-tensors removed weight_g_idx checkpoints, "
                "so transformers and vLLM with current compressed-tensors cannot load them",
                hint="--actorder static orders columns by activation too and keeps groups contiguous",
            )
        if self.fallback_threshold is not None and self.fallback != "auto":
            raise InputError("--fallback-threshold sets the inline scan's threshold: use --fallback auto")  # fmt: skip
        clip = get_scheme(self.scheme).clip_for(self.method) if self.clip is None else self.clip
        self.mixed()  # its options checked before the rest
        return _recipe(self, scheme=self.scheme, actorder=self.actorder, clip=clip)

    def mixed(self) -> MixedConfig | None:
        """Mixed precision's config when a budget is given; its other options alone are refused."""
        if self.target_bits is None and self.max_size is None:
            stray = self._changed(MIXED_OPTIONS)
            if stray:
                raise InputError(f"--{stray[0].replace('_', '-')}: chooses schemes under a budget", hint="add --target-bits or --max-size")  # fmt: skip
            return None
        size = None if self.max_size is None else parse_size(self.max_size, "--max-size")
        if size == 0:
            raise InputError(f"--max-size {self.max_size}: a size of no bytes holds no model")
        return build(
            MixedConfig, target_bits=self.target_bits, max_size=size, candidates=self.candidates,
            sensitivity=self.sensitivity, fisher_windows=self.fisher_windows,
            max_ppl_increase=self.max_ppl_increase, eval_text=self.eval_text,
            eval_windows=self.eval_windows, step_bits=self.step_bits,
        )  # fmt: skip

    def gguf_recipe(self) -> GGUFRecipe:
        """The GGUF export these options ask for. Its own options, the calibration's and
        `--skip-layer-check` (no importance matrix: data-free) apply; a compressed-tensors
        option given with it is refused, not ignored."""
        foreign = self._changed(set(type(self).model_fields) - GGUF_OPTIONS)
        if foreign:
            raise InputError(f"--{foreign[0].replace('_', '-')}: not an option of --format gguf")
        if self.method not in ("rtn", "gptq"):
            raise InputError(f"--method {self.method}: GGUF export takes rtn or gptq")
        data_free = self.skip_layer_check or self.imatrix == "none"
        if self.method == "gptq" and (data_free or self.imatrix):
            raise InputError(
                "--method gptq: its Hessians come from the calibration pass, not an imatrix",
                hint="drop --imatrix / --skip-layer-check",
            )
        samples = self.num_samples or DEFAULT_CALIB_SAMPLES
        mixed = self.mixed()
        measured = mixed is not None and mixed.sensitivity != "weight"
        wants_data = not data_free and (measured or not self.imatrix)
        calibration = self.calibration(samples) if wants_data else None
        return build(
            GGUFRecipe,
            # compressed-tensors' default scheme stands for GGUF's
            scheme=GGUFRecipe().scheme if self.scheme == default(QuantizeOptions, "scheme") else self.scheme,
            method=self.method,
            tensor_types=self.tensor_type,
            imatrix=None if self.imatrix == "none" else self.imatrix,
            calibration=calibration,
            mixed=mixed,
        )  # fmt: skip

    def calibration_given(self) -> list[str]:
        """The calibration options given (other than their defaults): a request for data."""
        return self._changed(CalibrationOptions.model_fields)

    def _changed(self, names: Any) -> list[str]:
        """Which of `names` ask for something: other than their default, "none" or empty."""
        fields = type(self).model_fields
        unset = (None, "none", ())
        return sorted(
            name for name in names if getattr(self, name) not in (fields[name].default, *unset)
        )

    @property
    def calibrated(self) -> bool:
        """Whether the recipe needs data: a calibrated method, options that read activations, or
        a scheme that calibrates its input scales (NVFP4's global scale)."""
        inputs = get_scheme(self.scheme).input_activations
        return (
            self.method not in DATA_FREE_METHODS
            or self.activations == "static"
            or any(option not in (None, "none") for option in (self.smooth, self.kv_cache))
            or (inputs is not None and inputs.dynamic == "local")
            or (self.mixed() is not None and self.sensitivity != "weight")
        )


GGUF_ONLY = ("tensor_type", "imatrix")
MIXED_OPTIONS = (
    "candidates", "sensitivity", "fisher_windows", "max_ppl_increase", "eval_text",
    "eval_windows", "step_bits",
)  # fmt: skip
GGUF_OPTIONS = {
    "format", "scheme", "method", *GGUF_ONLY, "skip_layer_check",
    *CalibrationOptions.model_fields,
    "target_bits", "max_size", "candidates", "sensitivity", "fisher_windows",  # per-tensor types
}  # fmt: skip


class StructuredOptions(CalibrationOptions):
    """`llmq prune --structured`: the sizes to keep (or a parameter budget) and how importance is
    scored."""

    params: Fraction | None = Field(None, gt=0.0, lt=1.0)  # a share of all the parameters
    decoder_params: Fraction | None = Field(None, gt=0.0, lt=1.0)  # of the decoder layers'
    intermediate_size: int | None = Field(None, ge=1)
    num_kv_heads: int | None = Field(None, ge=1)
    num_heads: int | None = Field(None, ge=1)
    hidden_size: int | None = Field(None, ge=1)
    num_layers: int | None = Field(None, ge=1)
    depth_metric: Literal["block", "ppl"] = "block"
    importance: FilePath | None = None  # scores saved by an earlier run
    save_importance: FilePath | None = None
    evaluate: bool = True  # held-out perplexity of the source and the result

    @property
    def samples(self) -> int:
        return DEFAULT_CALIB_SAMPLES if self.num_samples is None else self.num_samples


def _recipe(options: LayerOptions, *, scheme: str, actorder: str, clip: str) -> Recipe:
    """The nested Recipe of pruning or quantizing options."""
    quantizing = isinstance(options, QuantizeOptions)
    method = options.method  # type: ignore[attr-defined]
    if options.skip_layer_check and method not in DATA_FREE_METHODS:
        raise InputError(f"--skip-layer-check: {method} needs calibration data", hint="only rtn and magnitude can skip it")  # fmt: skip
    if clip == "output" and options.skip_layer_check:
        raise InputError("--clip output weighs errors by calibration data; drop --skip-layer-check")
    calibrated = options.calibrated if quantizing else method not in DATA_FREE_METHODS  # type: ignore[attr-defined]
    samples = options.num_samples or (DEFAULT_CALIB_SAMPLES if calibrated else DEFAULT_REPORT_SAMPLES)  # fmt: skip
    extra = {}
    if quantizing:
        q: QuantizeOptions = options  # type: ignore[assignment]
        extra = {
            "group_size": q.group_size,
            "strict_group_size": q.strict_group_size,
            "awq": {"grid": q.awq_grid, "duo_scaling": q.awq_duo_scaling},
            "smooth": parse_smooth(q.smooth),
            "activations": q.activations,
            "observer": q.observer,
            "kv_cache": None if q.kv_cache in (None, "none") else q.kv_cache,
            "targets": q.targets,
            "mixed": q.mixed(),
        }
    return build(
        Recipe,
        scheme=get_scheme(scheme),
        method=method,
        ignore=tuple(dict.fromkeys(("lm_head", *options.ignore))),
        clip=clip,
        calibration=None if options.skip_layer_check else options.calibration(samples),
        gptq={"dampening_frac": options.dampening_frac, "actorder": actorder,
              "block_size": options.block_size, "true_sequential": options.true_sequential},
        sparsity=options.sparsity,
        pattern=options.pattern,
        sparsity_profile=options.sparsity_profile,
        **extra,
    )  # fmt: skip


SPARSE_FORMAT_REFUSAL = (
    "compressed-tensors 0.15 removed its sparse compressors (0.20 cannot write the format) and "
    "transformers drops a sparsity_config: a plain from_pretrained re-initialises every pruned "
    "linear at random, with only a load-report warning (measured with transformers 5.23, "
    "compressed-tensors 0.20)"
)


def check_sparse_format(sparse_format: str) -> None:
    """Only "dense" is written; "bitmask" is refused with the reason (SPARSE_FORMAT_REFUSAL)."""
    if sparse_format == "bitmask":
        raise InputError(
            f"--sparse-format bitmask: no current loader reads it back ({SPARSE_FORMAT_REFUSAL})",
            hint="pruned checkpoints are written dense: they load everywhere",
        )
    if sparse_format != "dense":
        raise InputError(f"--sparse-format {sparse_format!r}: choose dense (or bitmask, refused)")
