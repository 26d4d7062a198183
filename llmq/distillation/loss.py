"""Distillation losses over logits [batch, seq, vocab] and hidden states [batch, seq, hidden].

Every loss is a mean over tokens, so gradient accumulation and data-parallel averaging of
equal-sized micro-batches give the loss of the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from llmq.config import DistillConfig

ACCUM_DTYPE = torch.float32  # softmax and KL in float32 even when the models run in bf16


def kl_divergence(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    temperature: float = 1.0,
    reverse: bool = False,
) -> Tensor:
    """Mean over tokens of KL(p_t || p_s) (forward) or KL(p_s || p_t) (reverse), with both
    distributions softened by `temperature` T and the result scaled by T², so the gradient's
    size does not depend on T (Hinton et al. 2015). Logits: [..., vocab]."""
    s = F.log_softmax(_soften(student_logits, temperature), dim=-1)
    t = F.log_softmax(_soften(teacher_logits, temperature), dim=-1)
    # kl_div(input, target) = sum exp(target) · (target - input) = KL(target || input)
    inputs, target = (t, s) if reverse else (s, t)
    per_token = F.kl_div(inputs, target, log_target=True, reduction="none").sum(dim=-1)
    return per_token.mean() * temperature**2


def _soften(logits: Tensor, temperature: float) -> Tensor:
    """logits / T in float32; no copy at T = 1 (a vocab-wide tensor per window)."""
    logits = logits.to(ACCUM_DTYPE)
    return logits if temperature == 1.0 else logits / temperature


def next_token_ce(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Mean cross-entropy of predicting token i + 1 from positions <= i. logits: [b, s, v],
    input_ids: [b, s]."""
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).to(ACCUM_DTYPE), input_ids[:, 1:].reshape(-1)
    )


def hidden_cosine(student: list[Tensor], teacher: list[Tensor]) -> Tensor:
    """Mean over matched layer pairs and tokens of 1 - cos(h_s, h_t) (DistilBERT)."""
    losses = [
        1.0 - F.cosine_similarity(s.to(ACCUM_DTYPE), t.to(ACCUM_DTYPE), dim=-1).mean()
        for s, t in zip(student, teacher, strict=True)
    ]
    return torch.stack(losses).mean()


def layer_pairs(
    student_layers: int, teacher_layers: int, kept: list[int] | None
) -> list[tuple[int, int]]:
    """(student layer, teacher layer) whose outputs the hidden-state loss matches: the layers
    a depth-pruned student kept (`kept`, from its llmq.json), else spread evenly (student
    layer i with teacher layer round((i + 1) · T / S) - 1, so the last layers pair up)."""
    if kept is not None:
        return list(enumerate(kept))
    return [
        (i, round((i + 1) * teacher_layers / student_layers) - 1) for i in range(student_layers)
    ]


def distillation_loss(
    config: DistillConfig,
    input_ids: Tensor,
    student_logits: Tensor,
    teacher_logits: Tensor | None,
    hidden_pairs: tuple[list[Tensor], list[Tensor]] | None = None,
) -> Tensor:
    """The configured loss of one micro-batch."""
    if config.loss == "ce":
        return next_token_ce(student_logits, input_ids)
    assert teacher_logits is not None  # every KL loss runs the teacher
    loss = kl_divergence(
        student_logits, teacher_logits,
        temperature=config.temperature, reverse=config.loss == "reverse-kl",
    )  # fmt: skip
    if config.ce_weight:
        loss = loss + config.ce_weight * next_token_ce(student_logits, input_ids)
    if config.hidden_weight:
        assert hidden_pairs is not None  # the loop asks for hidden states when this is set
        loss = loss + config.hidden_weight * hidden_cosine(*hidden_pairs)
    return loss
