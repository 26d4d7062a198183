"""The learning rate at each optimizer step: linear warm-up, then cosine decay."""

from __future__ import annotations

import math

from llmq.config import DistillConfig


def learning_rate(step: int, config: DistillConfig) -> float:
    """The learning rate of optimizer step `step` (0-based): rising linearly to `lr` over the
    first `warmup_steps` steps (the first step already moves), then falling along a half cosine
    to `min_lr_ratio` · lr at the last step."""
    peak, floor = config.lr, config.lr * config.min_lr_ratio
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    decay_steps = config.max_steps - config.warmup_steps - 1
    progress = 1.0 if decay_steps == 0 else (step - config.warmup_steps) / decay_steps
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
