"""How `distill` trains a student on a teacher: the loss, the data, the optimizer, the schedule.

The whole object is written into the output's llmq.json, and a resumed run must have the same
one: the result of a resumed run is then identical to an uninterrupted one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class DistillConfig(BaseModel):
    """Knowledge distillation of a causal LM (Hinton et al. 2015; Minitron, arXiv 2407.14679).

    loss: forward-kl KL(teacher || student) of the token distributions at `temperature`
    (mode-covering, what Minitron uses), reverse-kl KL(student || teacher) (mode-seeking, as
    MiniLLM), or ce: plain next-token cross-entropy on the text, no teacher (fine-tuning, the
    baseline distillation has to beat). `ce_weight` adds cross-entropy to a KL loss and
    `hidden_weight` a cosine loss between matched layers' hidden states (DistilBERT's triple
    loss).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    loss: DistillLoss = "forward-kl"
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    ce_weight: float = Field(0.0, ge=0.0)
    hidden_weight: float = Field(0.0, ge=0.0)
    # Training text: calibration splits of the built-ins (never the held-out ones), files, or
    # cached datasets; packed into consecutive seq_len windows, shuffled once per epoch.
    data: str = DEFAULT_CALIBRATION_TEXT
    seq_len: int = Field(512, ge=8, le=131_072)
    batch_size: int = Field(1, ge=1, le=4096)  # windows per forward pass, per process
    grad_accum: int = Field(8, ge=1, le=4096)  # forward passes per optimizer step
    max_steps: int = Field(ge=1)
    # AdamW; learning rate: linear warm-up, then cosine down to min_lr_ratio x lr
    lr: float = Field(1e-4, gt=0.0, lt=1.0)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
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
    # Pruning while training, to `sparsity` (or the N:M `pattern`); pruned weights stay zero.
    # gmp: gradual pruning (Zhu & Gupta 2017, llmq.distillation.gmp): the decoder linears'
    # sparsity rises along the cubic schedule from 0 at prune_start to the target at prune_end
    # (default: 3/4 of max_steps), masks recomputed every prune_every steps from the weights'
    # magnitudes or Wanda's metric on running input norms (prune_method).
    # iterative: `rounds` of one-shot pruning by `llmq prune --method prune_method` (or
    # `--structured`, sparsity then the share of the decoder's parameters removed) then
    # distillation for max_steps / rounds steps (llmq.api.iterative).
    prune: Literal["none", "gmp", "iterative"] = "none"
    prune_method: Literal["magnitude", "wanda", "sparsegpt", "structured"] = "magnitude"
    sparsity: float | None = Field(None, gt=0.0, lt=1.0)
    pattern: str | None = Field(None, pattern=r"^\d+:\d+$")
    prune_start: int = Field(0, ge=0)
    prune_end: int | None = Field(None, ge=1)
    prune_every: int = Field(1, ge=1)
    rounds: int = Field(ITERATIVE_ROUNDS, ge=1, le=100)
    # iterative: the sparsity after each round (llmq.api.iterative.round_sparsities)
    round_schedule: Literal["cubic", "geometric"] = "cubic"
    # Quantization-aware distillation (llmq.distillation.qat): the decoder linears run on the
    # scheme's fake-quantized weights, and w8a8/fp8 on fake-quantized inputs per token
    # (straight-through gradients); the result is written as that scheme's compressed-tensors
    # checkpoint, by `llmq quantize`'s RTN.
    qat: QatScheme | None = None
    qat_group_size: int | None = None  # -1: per channel
    # start from the float weights or `llmq quantize --method gptq|awq`'s solution
    qat_init: Literal["float", "gptq", "awq"] = "float"

    @model_validator(mode="after")
    def _consistent(self) -> DistillConfig:
        if self.loss == "ce" and (self.ce_weight or self.hidden_weight):
            raise ValueError("loss ce trains on the text alone: ce_weight and hidden_weight need a KL loss")  # fmt: skip
        if self.loss == "ce" and self.temperature != 1.0:
            raise ValueError("temperature softens the teacher's distribution: loss ce has none")
        if (
            self.max_steps is not None and self.warmup_steps >= self.max_steps
        ):  # a recipe may give tokens
            raise ValueError(f"warmup_steps {self.warmup_steps}: must be fewer than max_steps {self.max_steps}")  # fmt: skip
        # Built-in texts have disjoint training and held-out splits; a file has one split only.
        if set(self.data.split("+")) & set(self.eval_text.split("+")) - set(BUILTIN_TEXTS):
            raise ValueError(f"eval_text {self.eval_text!r} is also the training data: held-out text must not be trained on")  # fmt: skip
        _check_pruning(self)
        if self.qat is None and (self.qat_group_size is not None or self.qat_init != "float"):
            raise ValueError("qat_group_size and qat_init set up qat: give qat")
        if self.qat_group_size is not None and not is_valid_group_override(self.qat_group_size):
            raise ValueError(f"qat_group_size {self.qat_group_size} is not {GROUP_OVERRIDE_RULE}")  # fmt: skip
        return self

    @property
    def uses_teacher(self) -> bool:
        return self.loss != "ce"

    @property
    def pruning_end(self) -> int:
        """The step at which GMP reaches its final sparsity."""
        if self.prune_end is not None:
            return self.prune_end
        return max(self.prune_start + 1, (self.max_steps or 0) * 3 // 4)

    @property
    def nm_pattern(self) -> tuple[int, int] | None:
        return nm_pattern(self.pattern)


_GMP_ONLY = {"prune_start": 0, "prune_end": None, "prune_every": 1}


def _check_pruning(config: DistillConfig) -> None:
    given = [name for name in ("sparsity", "pattern") if getattr(config, name) is not None]
    if config.prune != "iterative" and config.rounds != ITERATIVE_ROUNDS:
        raise ValueError("rounds: prunes only with prune iterative")
    if config.prune != "iterative" and config.round_schedule != "cubic":
        raise ValueError("round_schedule: prunes only with prune iterative")
    if config.prune == "none":
        changed = [*given, *(["prune_method"] if config.prune_method != "magnitude" else [])]
        if changed:
            raise ValueError(f"{changed[0]}: prunes only with prune gmp or iterative")
        return
    if config.prune == "iterative":
        _check_iterative(config)
        return
    if len(given) != 1:
        raise ValueError("prune gmp: give either sparsity or pattern (one of them)")
    nm_pattern(config.pattern)  # 0 < N < M
    if config.prune_method in ("sparsegpt", "structured"):
        raise ValueError(f"prune gmp: scores single weights by magnitude or wanda; {config.prune_method} prunes in one shot (use prune iterative)")  # fmt: skip
    if config.max_steps is not None:
        if config.pruning_end <= config.prune_start:
            raise ValueError(f"prune_end {config.pruning_end}: must come after prune_start {config.prune_start}")  # fmt: skip
        if config.pruning_end > config.max_steps:
            raise ValueError(f"prune_end {config.pruning_end}: after the last step ({config.max_steps})")  # fmt: skip


def _check_iterative(config: DistillConfig) -> None:
    if config.sparsity is None:
        raise ValueError("prune iterative: give sparsity (an N:M pattern has no steps in between)")
    gmp_options = [k for k, default in _GMP_ONLY.items() if getattr(config, k) != default]
    if gmp_options:
        raise ValueError(f"{gmp_options[0]}: sets GMP's schedule; prune iterative prunes once a round")  # fmt: skip
    if config.qat is not None:
        raise ValueError("prune iterative: not with qat (quantize the pruned result afterwards)")
    if config.max_steps is not None and config.max_steps % config.rounds:
        raise ValueError(f"max_steps {config.max_steps}: not a multiple of rounds {config.rounds}")  # fmt: skip
