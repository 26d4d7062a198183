"""What every verb of the API shares: opening a model, its tokenizer, calibration windows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmq.config import (
    CalibConfig,
)
from llmq.models import BUILTIN_MODELS, cache_dir, resolve_model
from llmq.progress import NO_PROGRESS, Progress

DEFAULT_REPORT_SAMPLES = 1
"""Calibration windows RTN uses by default: it needs no data, so they only feed the per-layer
output-error report."""
DEFAULT_CALIB_SAMPLES = 128


def _tokenizer(folder: Path) -> Any:
    from llmq.calib.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def _calibration_windows(model_dir: Path, cal: CalibConfig, progress: Progress) -> Any:
    from llmq.calib.data import calibration_windows

    with progress.stage(f"sampling calibration text {cal.text}"):
        return calibration_windows(
            _tokenizer(model_dir),
            cal.text,
            num_samples=cal.num_samples,
            seq_len=cal.seq_len,
            seed=cal.seed,
        )


def _open(model: str | Path, progress: Progress = NO_PROGRESS) -> Any:
    from llmq.io.checkpoint import open_checkpoint

    return open_checkpoint(resolve_model(model, progress=progress))


def list_models() -> list[dict[str, str]]:
    """The built-in models: name, description, and whether they are already cached."""
    return [
        {
            "name": m.name,
            "description": m.description,
            "cached": str((cache_dir() / "models" / m.name / "config.json").is_file()).lower(),
        }
        for m in BUILTIN_MODELS.values()
    ]
