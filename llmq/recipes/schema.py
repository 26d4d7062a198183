"""A recipe: llmq's stages in order, each with the options of the command it runs.

Keys are the command-line options' names with underscores for dashes, so the smallest recipe is

    stages:
      - quantize:
          scheme: w4a16
          group_size: 64

Each stage reads the previous stage's output (the first reads the recipe's model); `teacher`
and `baseline` name the model to compare with: `source` (the recipe's model, the default), an
earlier stage by name, or a folder. No torch here: the stages only say what to run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmq.config import DEFAULT_CONFIDENCE
from llmq.config.distill import DistillConfig
from llmq.texts import DEFAULT_CALIBRATION_TEXT, DEFAULT_EVAL_TEXT, text_inputs

SOURCE = "source"  # the recipe's own model, in `teacher` and `baseline`


class StageError(ValueError):
    """A recipe error that belongs to one stage (so that its line can be named)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class _Stage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")  # default: kind, numbered


class _Calibrated(_Stage):
    calib_text: str = DEFAULT_CALIBRATION_TEXT
    num_samples: int | None = None  # the method's default
    seq_len: int = 512
    seed: int = 0
    ignore: list[str] = []
    dampening_frac: float = 0.01
    true_sequential: bool = True


class QuantizeStage(_Calibrated):
    """`llmq quantize`."""

    scheme: str = "w4a16"
    method: str = "rtn"
    group_size: int | None = None
    strict_group_size: bool = False
    clip: str | None = None
    actorder: str = "static"
    block_size: int = 128
    awq_grid: int = 20
    awq_duo_scaling: bool = True
    smooth: str | float | None = None
    activations: str = "dynamic"
    observer: str = "absmax"
    kv_cache: str | None = None
    sparsity: float | None = None
    pattern: str | None = None
    sparsity_profile: str = "uniform"
    fallback: str | None = None
    fallback_threshold: float | None = None


class PruneStage(_Calibrated):
    """`llmq prune`: one-shot (method with sparsity or pattern), or `structured: true`."""

    method: str = "sparsegpt"
    sparsity: float | None = None
    pattern: str | None = None
    sparsity_profile: str = "uniform"
    structured: bool = False
    params: float | None = None
    decoder_params: float | None = None
    intermediate_size: int | None = None
    num_kv_heads: int | None = None
    num_heads: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    # structured: held-out perplexity of the source and the result in the stage's summary (off
    # by default in a recipe, where an eval stage gates).
    evaluate: bool = False

    @model_validator(mode="after")
    def _one_mode(self) -> PruneStage:
        sizes = (self.params, self.decoder_params, self.intermediate_size, self.num_kv_heads, self.num_heads,
                 self.hidden_size, self.num_layers)  # fmt: skip
        if not self.structured and (any(size is not None for size in sizes) or self.evaluate):
            raise ValueError("params, the sizes and evaluate go with structured: true")
        if self.structured and (self.sparsity is not None or self.pattern is not None):
            raise ValueError("sparsity and pattern prune single weights: not with structured: true")  # fmt: skip
        return self


class DistillStage(DistillConfig):
    """`llmq distill`: the previous stage's output is the student; DistillConfig's keys."""

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    teacher: str = SOURCE
    max_steps: int | None = Field(None, ge=1)  # type: ignore[assignment]  # or max_tokens
    max_tokens: int | None = Field(None, ge=1)
    checkpoint_every: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _length(self) -> DistillStage:
        if (self.max_tokens is None) == (self.max_steps is None):
            raise ValueError("how long to train: give max_steps or max_tokens (one of them)")
        return self

    def options(self) -> dict[str, Any]:
        """The DistillConfig keys, for `distill(..., **options)`."""
        return {k: v for k, v in self.model_dump().items() if k in DistillConfig.model_fields}


class EvalStage(_Stage):
    """`llmq eval` of the previous stage's output against `baseline`, as a gate: perplexity
    (`max_ppl_increase`), or with `tasks` lm-eval accuracy (`max_drop`, `min_recovery`: one
    value for every task, or a mapping per task)."""

    baseline: str = SOURCE
    text: str = DEFAULT_EVAL_TEXT
    seq_len: int = Field(512, ge=8)
    max_windows: int = Field(40, ge=1)
    max_ppl_increase: float | None = Field(None, ge=0.0, lt=100.0)
    tasks: list[str] | None = None
    task_dir: str | None = None
    limit: int | None = Field(None, ge=1)
    num_fewshot: int | None = Field(None, ge=0)
    max_drop: float | dict[str, float] | None = None
    min_recovery: float | dict[str, float] | None = None
    confidence: float = Field(DEFAULT_CONFIDENCE, ge=0.5, lt=1.0)
    batch_size: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _one_kind(self) -> EvalStage:
        if self.tasks is None and (self.max_drop is not None or self.min_recovery is not None):
            raise ValueError("max_drop and min_recovery gate task accuracy: give tasks")
        if self.tasks is not None and self.max_ppl_increase is not None:
            raise ValueError("max_ppl_increase gates perplexity: with tasks use max_drop or min_recovery")  # fmt: skip
        return self


_NEEDS_FLOAT = {"quantize": "quantizes", "prune": "prunes", "distill": "trains"}
StageKind = Literal["quantize", "prune", "distill", "eval"]
STAGES: dict[str, type[_Stage]] = {
    "quantize": QuantizeStage,
    "prune": PruneStage,
    "distill": DistillStage,
    "eval": EvalStage,
}


class StageEntry(BaseModel):
    """One item of `stages`: a mapping with exactly one key, the stage's kind."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    quantize: QuantizeStage | None = None
    prune: PruneStage | None = None
    distill: DistillStage | None = None
    eval: EvalStage | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StageEntry:
        given = [kind for kind in STAGES if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(f"a stage is one of {', '.join(STAGES)}; found {len(given)}")
        return self

    @property
    def kind(self) -> StageKind:
        return next(kind for kind in STAGES if getattr(self, kind) is not None)  # type: ignore[return-value]

    @property
    def stage(self) -> Any:
        return getattr(self, self.kind)


class ChainRecipe(BaseModel):
    """A recipe file: the stages, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    stages: list[StageEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _references(self) -> ChainRecipe:
        """Stage names are unique, and `teacher` / `baseline` name the source, an earlier
        stage that writes a checkpoint, or a folder."""
        names = self.stage_names()
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {', '.join(names)}")
        quantized = next((i for i, e in enumerate(self.stages) if e.kind == "quantize"), None)
        later = [i for i, e in enumerate(self.stages) if e.kind != "eval" and quantized is not None and i > quantized]  # fmt: skip
        if later:
            raise StageError(later[0], f"stage {names[later[0]]} {_NEEDS_FLOAT[self.stages[later[0]].kind]} a float model, but {names[quantized]} before it writes a quantized one")  # fmt: skip
        for index, entry in enumerate(self.stages):
            reference = getattr(entry.stage, "teacher", None) or getattr(entry.stage, "baseline", None)  # fmt: skip
            if reference in names[index:]:
                raise StageError(index, f"stage {names[index]} compares with {reference}, which runs later (or is itself)")  # fmt: skip
            if reference in names[:index] and self.stages[names.index(reference)].kind == "eval":
                raise StageError(index, f"stage {names[index]} compares with {reference}, an eval stage that writes no model")  # fmt: skip
        return self

    def inputs(self) -> list[tuple[str, Path]]:
        """The files and folders the stages read besides the recipe's model (a `teacher` or
        `baseline` folder, text files, a task folder), as (role, path): no output may cover
        them."""
        names = self.stage_names()
        found: list[tuple[str, Path]] = []
        for entry in self.stages:
            stage = entry.stage
            for role in ("teacher", "baseline"):
                reference = getattr(stage, role, None)
                if reference is not None and reference != SOURCE and reference not in names:
                    found.append((role, Path(reference)))
            for key in ("calib_text", "text", "data", "eval_text"):
                found += text_inputs(getattr(stage, key, None), "text")
            if getattr(stage, "task_dir", None) is not None:
                found.append(("task folder", Path(stage.task_dir)))
        return found

    def stage_names(self) -> list[str]:
        """Each stage's name: its own, else its kind, numbered from the second of a kind."""
        names, seen = [], {}
        for entry in self.stages:
            seen[entry.kind] = seen.get(entry.kind, 0) + 1
            default = entry.kind if seen[entry.kind] == 1 else f"{entry.kind}-{seen[entry.kind]}"
            names.append(entry.stage.name or default)
        return names
