"""How `distill` trains a student on a teacher: the loss, the data, the optimizer, the schedule.

The whole object is written into the output's llmq.json, and a resumed run must have the same
one: the result of a resumed run is then identical to an uninterrupted one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from llmq.config.fraction import Fraction
from llmq.config.quant import GROUP_OVERRIDE_RULE, is_valid_group_override, nm_pattern
from llmq.texts import BUILTIN_TEXTS, DEFAULT_CALIBRATION_TEXT, DEFAULT_EVAL_TEXT

DISTILL_RESUME_EVERY_S = 300.0
"""Seconds between `distill`'s resume points by default: one holds the student and AdamW's two
moments in float32 (1.6 GB for the default model, a few seconds to write), so every 5 minutes
costs about 1% of the run and an interruption loses at most 5 minutes."""

ITERATIVE_ROUNDS = 3
"""Rounds of `prune iterative` by default: ModelOpt's advice above 50% sparsity is to prune
about 30% at a time; three rounds reach 70% (the cubic schedule: 49%, 67%, 70%)."""

DistillLoss = Literal["forward-kl", "reverse-kl", "ce"]
QatScheme = Literal["w4a16", "w4a16-asym", "w8a16", "w8a8", "fp8"]
"""Schemes quantization-aware distillation trains for: their RTN export needs no calibration
(weight-only, or activations quantized per token at run time; static activation scales would be
calibrated after training, not trained)."""


class _SubConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class GmpConfig(_SubConfig):
    """Gradual magnitude pruning while training (Zhu & Gupta 2017, llmq.distillation.gmp): the
    decoder linears' sparsity rises along the cubic schedule from 0 at `start` to `sparsity` (or
    the N:M `pattern`) at `end` (default: 3/4 of max_steps); masks are recomputed every `every`
    steps from the weights' magnitudes or Wanda's metric on running input norms (`method`)."""

    method: Literal["magnitude", "wanda"] = "magnitude"
    sparsity: Fraction | None = Field(None, gt=0.0, lt=1.0)
    pattern: str | None = Field(None, pattern=r"^\d+:\d+$")
    start: int = Field(0, ge=0)
    end: int | None = Field(None, ge=1)
    every: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _one_target(self) -> GmpConfig:
        if (self.sparsity is None) == (self.pattern is None):
            raise ValueError("give either sparsity or pattern (one of them)")
        nm_pattern(self.pattern)  # 0 < N < M
        return self

    def end_step(self, max_steps: int) -> int:
        """The step at which the final sparsity is reached."""
        return self.end if self.end is not None else max(self.start + 1, max_steps * 3 // 4)

    @property
    def nm_pattern(self) -> tuple[int, int] | None:
        return nm_pattern(self.pattern)


class IterativeConfig(_SubConfig):
    """`rounds` of one-shot pruning by `llmq prune --method method` (or `--structured`: sparsity
    is then the share of the decoder's parameters removed) then distillation for max_steps /
    rounds steps, to the sparsity after each round of `schedule` (llmq.recipes.iterative)."""

    method: Literal["magnitude", "wanda", "sparsegpt", "structured"] = "magnitude"
    sparsity: Fraction = Field(gt=0.0, lt=1.0)
    rounds: int = Field(ITERATIVE_ROUNDS, ge=1, le=100)
    schedule: Literal["cubic", "geometric"] = "cubic"


class QatConfig(_SubConfig):
    """Quantization-aware distillation (llmq.distillation.qat): the decoder linears run on the
    scheme's fake-quantized weights, and w8a8/fp8 on fake-quantized inputs per token
    (straight-through gradients); the result is written as that scheme's compressed-tensors
    checkpoint, by `llmq quantize`'s RTN. `init`: start from the float weights or `llmq
    quantize --method gptq|awq`'s solution."""

    scheme: QatScheme
    group_size: int | None = None  # None: the scheme's; -1: per channel
    init: Literal["float", "gptq", "awq"] = "float"

    @model_validator(mode="after")
    def _group_size(self) -> QatConfig:
        if self.group_size is not None and not is_valid_group_override(self.group_size):
            raise ValueError(f"group_size {self.group_size} is not {GROUP_OVERRIDE_RULE}")
        return self


class DistillConfig(BaseModel):
    """Knowledge distillation of a causal LM (Hinton et al. 2015; Minitron, arXiv 2407.14679).

    loss: forward-kl KL(teacher || student) of the token distributions at `temperature`
    (mode-covering, what Minitron uses), reverse-kl KL(student || teacher) (mode-seeking, as
    MiniLLM), or ce: plain next-token cross-entropy on the text, no teacher (fine-tuning, the
    baseline distillation has to beat). `ce_weight` adds cross-entropy to a KL loss and
    `hidden_weight` a cosine loss between matched layers' hidden states (DistilBERT's triple
    loss). Pruning while training is `gmp` or `iterative` (not both), quantization-aware
    training `qat`: each a sub-config holding only its own options.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    loss: DistillLoss = "forward-kl"
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    ce_weight: float = Field(0.0, ge=0.0)
    hidden_weight: float = Field(0.0, ge=0.0)
    # Training text: calibration splits of the built-ins (never the held-out ones), files, or
    # cached datasets; packed into consecutive seq_len windows, shuffled once per epoch.
    train_text: str = Field(DEFAULT_CALIBRATION_TEXT, validation_alias=AliasChoices("train_text", "data"))  # fmt: skip
    seq_len: int = Field(512, ge=8, le=131_072)
    batch_size: int = Field(1, ge=1, le=4096)  # windows per forward pass, per process
    grad_accum: int = Field(8, ge=1, le=4096)  # forward passes per optimizer step
    max_steps: int = Field(ge=1)
    # AdamW; learning rate: linear warm-up, then cosine down to min_lr_ratio x lr
    lr: float = Field(1e-4, gt=0.0, lt=1.0)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: Fraction = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0, lt=1.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    seed: int = 0
    # Held-out perplexity of the student, at step 0, every eval_every steps (0: only at the
    # end) and at the end; `keep` best writes the student with the lowest one.
    eval_text: str = DEFAULT_EVAL_TEXT
    eval_windows: int = Field(16, ge=1, le=100_000)
    eval_seq_len: int = Field(512, ge=8, le=131_072)
    eval_every: int = Field(0, ge=0)
    keep: Literal["best", "last"] = "best"
    gmp: GmpConfig | None = None
    iterative: IterativeConfig | None = None
    qat: QatConfig | None = None

    @model_validator(mode="after")
    def _consistent(self) -> DistillConfig:
        if self.loss == "ce" and (self.ce_weight or self.hidden_weight):
            raise ValueError("loss ce trains on the text alone: ce_weight and hidden_weight need a KL loss")  # fmt: skip
        if self.loss == "ce" and self.temperature != 1.0:
            raise ValueError("temperature softens the teacher's distribution: loss ce has none")
        # A recipe stage may give max_tokens instead; these checks then wait for the steps.
        if self.max_steps is not None and self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps}: must be fewer than max_steps {self.max_steps}")  # fmt: skip
        # Built-in texts have disjoint training and held-out splits; a file has one split only.
        if set(self.train_text.split("+")) & set(self.eval_text.split("+")) - set(BUILTIN_TEXTS):
            raise ValueError(f"eval_text {self.eval_text!r} is also the training data: held-out text must not be trained on")  # fmt: skip
        if self.gmp is not None and self.max_steps is not None:
            _check_gmp(self.gmp, self.max_steps)
        if self.iterative is not None:
            _check_iterative(self)
        return self

    @property
    def uses_teacher(self) -> bool:
        return self.loss != "ce"

    @property
    def pruning(self) -> str:
        """How the student is pruned while it trains: none, gmp or iterative."""
        return "gmp" if self.gmp else "iterative" if self.iterative else "none"


def _check_gmp(gmp: GmpConfig, max_steps: int) -> None:
    end = gmp.end_step(max_steps)
    if end <= gmp.start:
        raise ValueError(f"gmp.end {end}: must come after gmp.start {gmp.start}")
    if end > max_steps:
        raise ValueError(f"gmp.end {end}: after the last step ({max_steps})")


def _check_iterative(config: DistillConfig) -> None:
    if config.gmp is not None:
        raise ValueError("gmp and iterative: prune one way (gradually, or in rounds)")
    if config.qat is not None:
        raise ValueError("iterative: not with qat (quantize the pruned result afterwards)")
    rounds = config.iterative.rounds if config.iterative else 1
    if config.max_steps is not None and config.max_steps % rounds:
        raise ValueError(f"max_steps {config.max_steps}: not a multiple of iterative.rounds {rounds}")  # fmt: skip
