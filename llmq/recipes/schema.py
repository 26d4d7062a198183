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

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_serializer, model_validator

from llmq.config import (
    DEFAULT_CONFIDENCE,
    CalibrationOptions,
    PruneOptions,
    QuantizeOptions,
    StructuredOptions,
)
from llmq.config.distill import DistillConfig
from llmq.config.fraction import Fraction
from llmq.texts import DEFAULT_EVAL_TEXT, text_inputs

SOURCE = "source"  # the recipe's own model, in `teacher` and `baseline`
STAGE_NAME = r"^[A-Za-z0-9_.-]+$"


class StageError(ValueError):
    """A recipe error that belongs to one stage (so that its line can be named)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class _Stage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str | None = Field(None, pattern=STAGE_NAME)  # default: kind, numbered


class QuantizeStage(QuantizeOptions):
    """`llmq quantize`: its options (llmq.config.options), and a name."""

    name: str | None = Field(None, pattern=STAGE_NAME)

    def options(self) -> QuantizeOptions:
        return QuantizeOptions(**self.model_dump(exclude={"name"}))


class PruneStage(PruneOptions, StructuredOptions):
    """`llmq prune`: one-shot (a method with sparsity or pattern), or `structured: true` and the
    structured options; each mode's options are refused in the other."""

    name: str | None = Field(None, pattern=STAGE_NAME)
    structured: bool = False
    # Off by default in a recipe (on for the command), where an eval stage measures and gates.
    evaluate: bool = False

    @model_validator(mode="after")
    def _one_mode(self) -> PruneStage:
        given = sorted(self.model_fields_set & self._other_mode())
        if given and self.structured:
            raise ValueError(f"{given[0]} prunes single weights: not with structured: true")
        if given:
            raise ValueError(f"{given[0]} goes with structured: true")
        return self

    @model_serializer(mode="wrap")
    def _this_mode(self, handler: Any) -> dict[str, Any]:
        """Dumped with its own mode's options only (the effective recipe a run records)."""
        return {k: v for k, v in handler(self).items() if k not in self._other_mode()}

    def _other_mode(self) -> set[str]:
        """The options of the other kind of pruning."""
        other = StructuredOptions if not self.structured else PruneOptions
        return set(other.model_fields) - set(CalibrationOptions.model_fields)

    def options(self) -> PruneOptions | StructuredOptions:
        kind = StructuredOptions if self.structured else PruneOptions
        return kind(**self.model_dump(include=set(kind.model_fields)))


class DistillStage(DistillConfig):
    """`llmq distill`: the previous stage's output is the student; DistillConfig's keys."""

    name: str | None = Field(None, pattern=STAGE_NAME)
    teacher: str = SOURCE
    max_steps: int | None = Field(None, ge=1)  # type: ignore[assignment]  # or max_tokens
    max_tokens: int | None = Field(None, ge=1)
    checkpoint_every: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _length(self) -> DistillStage:
        if (self.max_tokens is None) == (self.max_steps is None):
            raise ValueError("how long to train: give max_steps or max_tokens (one of them)")
        if self.iterative is not None:
            raise ValueError("iterative pruning is rounds of prune and distill stages: write them as stages (or run llmq distill --prune iterative)")  # fmt: skip
        return self

    def options(self) -> dict[str, Any]:
        """The DistillConfig keys, for `distill(..., **options)`."""
        return {k: v for k, v in self.model_dump().items() if k in DistillConfig.model_fields}


class EvalStage(_Stage):
    """`llmq eval` of the previous stage's output against `baseline`, as a gate: perplexity
    (`max_ppl_increase`), or with `tasks` lm-eval accuracy (`max_drop`, `min_recovery`: one
    value for every task, or a mapping per task)."""

    baseline: str = SOURCE
    # keys as `llmq eval`'s flags; `text` and `max_windows`, their old spellings, still read
    eval_text: str = Field(DEFAULT_EVAL_TEXT, validation_alias=AliasChoices("eval_text", "text"))
    seq_len: int = Field(512, ge=8)
    eval_windows: int = Field(40, ge=1, validation_alias=AliasChoices("eval_windows", "max_windows"))  # fmt: skip
    max_ppl_increase: Fraction | None = Field(None, ge=0.0, lt=100.0)
    tasks: list[str] | None = None
    task_dir: str | None = None
    limit: int | None = Field(None, ge=1)
    num_fewshot: int | None = Field(None, ge=0)
    max_drop: Fraction | dict[str, Fraction] | None = None
    min_recovery: Fraction | dict[str, Fraction] | None = None
    confidence: Fraction = Field(DEFAULT_CONFIDENCE, ge=0.5, lt=1.0)
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
            for key in ("calib_text", "train_text", "eval_text"):
                found += text_inputs(getattr(stage, key, None), "text")
            for role, key in (("task folder", "task_dir"), ("statistics file", "calib_stats"), ("importance file", "importance")):  # fmt: skip
                if getattr(stage, key, None) is not None:
                    found.append((role, Path(getattr(stage, key))))
            if getattr(stage, "fallback", None) not in (None, "auto"):
                found.append(("fallback report", Path(stage.fallback)))
        return found

    def stage_names(self) -> list[str]:
        """Each stage's name: its own, else its kind, numbered from the second of a kind."""
        names, seen = [], {}
        for entry in self.stages:
            seen[entry.kind] = seen.get(entry.kind, 0) + 1
            default = entry.kind if seen[entry.kind] == 1 else f"{entry.kind}-{seen[entry.kind]}"
            names.append(entry.stage.name or default)
        return names
