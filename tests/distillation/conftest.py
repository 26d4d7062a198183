"""The tiny teacher and its pruned student that the distillation tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmq
from tests.conftest import make_tiny, sharpen


@pytest.fixture(scope="package")
def teacher(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """A tiny random model with peaked next-token distributions: its (tied) embedding scaled
    up, so a student that differs from it has a KL divergence worth learning away (a random
    model's logits are nearly uniform over the 49k tokens)."""
    return sharpen(make_tiny(tmp_path_factory.mktemp("distill") / "teacher", default_model))


@pytest.fixture(scope="package")
def student(tmp_path_factory: pytest.TempPathFactory, teacher: Path) -> Path:
    """The teacher with half its MLP channels removed: what `prune --structured` hands over."""
    out = tmp_path_factory.mktemp("distill") / "student"
    llmq.prune_structured(
        teacher, out, intermediate_size=256, num_samples=4, seq_len=64, evaluate=False
    )
    return out
