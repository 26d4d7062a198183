"""A model's calibration windows, sampled once per tokenizer and settings where a batch shares
them.

`llmq batch` samples each (tokenizer, calibration settings) pair's windows once, before its jobs
start, into a folder every job reads (`sharing_windows`); a job outside a batch samples its own.
Windows depend on the tokenizer's files and the settings alone, so a pruned or distilled copy of
a model with the same tokenizer shares them (`windows_key`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

from llmq.calib.data import TokenWindows, calibration_windows
from llmq.calib.tokenizer import load_tokenizer
from llmq.config import CalibConfig
from llmq.io.cache import read_cached, write_cached
from llmq.progress import NO_PROGRESS, Progress


@dataclass(slots=True)
class SharedWindows:
    """A folder of windows shared by the jobs of one batch, and how many were read from it."""

    folder: Path
    reads: int = 0


_SHARED: ContextVar[SharedWindows | None] = ContextVar("llmq_shared_windows", default=None)


@contextmanager
def sharing_windows(folder: str | Path) -> Iterator[SharedWindows]:
    """Within the block, `model_windows` reads and writes windows in `folder`."""
    shared = SharedWindows(Path(folder))
    token = _SHARED.set(shared)
    try:
        yield shared
    finally:
        _SHARED.reset(token)


def model_windows(
    model_dir: Path, cal: CalibConfig, progress: Progress = NO_PROGRESS
) -> TokenWindows:
    """The calibration windows `cal` describes, tokenized by the model at `model_dir`."""
    shared = _SHARED.get()
    entry = shared.folder / f"{windows_key(model_dir, cal)}.pt" if shared else None
    if entry is not None and (windows := read_cached(entry, _load)) is not None:
        shared.reads += 1
        return windows
    with progress.stage(f"sampling calibration text {cal.text}"):
        windows = calibration_windows(
            load_tokenizer(model_dir),
            cal.text,
            num_samples=cal.num_samples,
            seq_len=cal.seq_len,
            seed=cal.seed,
        )
    if entry is not None:
        write_cached(entry, lambda path: _save(windows, path))
    return windows


def windows_key(model_dir: Path, cal: CalibConfig) -> str:
    """The tokenizer's files (their bytes: windows depend on nothing else of the model) and the
    calibration settings."""
    settings = cal.model_dump(exclude={"moe_calibration"})  # routing does not change the text
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in sorted(Path(model_dir).glob("tokenizer*")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:20]


def _save(windows: TokenWindows, path: Path) -> None:
    state = {"input_ids": windows.input_ids, "source": windows.source, "add_bos": windows.add_bos}
    torch.save(state, path)


def _load(path: Path) -> TokenWindows:
    return TokenWindows(**torch.load(path, weights_only=True))
