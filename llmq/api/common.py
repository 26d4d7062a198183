"""What every verb of the API shares: opening a model, its tokenizer, calibration windows."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from llmq.config import (
    CalibConfig,
)
from llmq.io.cache import read_cached, write_cached
from llmq.models import BUILTIN_MODELS, cache_dir, resolve_model
from llmq.progress import NO_PROGRESS, Progress

DEFAULT_REPORT_SAMPLES = 1
"""Calibration windows RTN uses by default: it needs no data, so they only feed the per-layer
output-error report."""
DEFAULT_CALIB_SAMPLES = 128


def _tokenizer(folder: Path) -> Any:
    from llmq.calib.tokenizer import load_tokenizer

    return load_tokenizer(folder)


SHARED_WINDOWS_ENV = "LLMQ_SHARED_WINDOWS"
"""A folder of calibration windows shared by the jobs of one `llmq batch`: computed once per
(model, calibration settings) by the batch, read by every job that needs them."""
shared_window_reads = 0  # how many times this process took windows from that folder


def _calibration_windows(model_dir: Path, cal: CalibConfig, progress: Progress) -> Any:
    global shared_window_reads
    from llmq.calib.data import calibration_windows

    shared = os.environ.get(SHARED_WINDOWS_ENV)
    entry = Path(shared) / f"{windows_key(model_dir, cal)}.pt" if shared else None
    if entry is not None and (windows := read_cached(entry, _load_windows)) is not None:
        shared_window_reads += 1
        return windows
    with progress.stage(f"sampling calibration text {cal.text}"):
        windows = calibration_windows(
            _tokenizer(model_dir),
            cal.text,
            num_samples=cal.num_samples,
            seq_len=cal.seq_len,
            seed=cal.seed,
        )
    if entry is not None:
        write_cached(entry, lambda path: _save_windows(windows, path))
    return windows


def windows_key(model_dir: Path, cal: CalibConfig) -> str:
    """The tokenizer's files (their bytes: windows depend on nothing else of the model) and the
    calibration settings; a pruned or distilled copy with the same tokenizer shares them."""
    digest = hashlib.sha256(json.dumps(cal.model_dump(), sort_keys=True).encode())
    for path in sorted(Path(model_dir).glob("tokenizer*")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:20]


def _save_windows(windows: Any, path: Path) -> None:
    import torch

    state = {"input_ids": windows.input_ids, "source": windows.source, "add_bos": windows.add_bos}
    torch.save(state, path)


def _load_windows(path: Path) -> Any:
    import torch

    from llmq.calib.data import TokenWindows

    return TokenWindows(**torch.load(path, weights_only=True))


def _open(model: str | Path, progress: Progress = NO_PROGRESS) -> Any:
    from llmq.io.checkpoint import open_checkpoint

    return open_checkpoint(resolve_model(model, progress=progress))


def list_models() -> list[dict[str, Any]]:
    """The built-in models: name, description, and whether they are already cached."""
    return [
        {
            "name": m.name,
            "description": m.description,
            "cached": (cache_dir() / "models" / m.name / "config.json").is_file(),
        }
        for m in BUILTIN_MODELS.values()
    ]
