"""Outputs appear complete or not at all: write under a temporary name, rename when done.

Nothing the user gave us is ever overwritten without `overwrite=True`; even then the old output
is only removed after the new one is in place.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmq.errors import InputError


def staging_path(out: Path) -> Path:
    """The partial output of a run into `out`; kept after an interruption for --resume."""
    return out.parent / f".{out.name}.llmq-partial"


def check_output_dir(out: Path, *, overwrite: bool, sources: tuple[Path, ...] = ()) -> None:
    """Refuse an existing output without overwrite, and an output that is one of the inputs."""
    resolved = out.resolve()
    for source in sources:
        if resolved == source.resolve():
            raise InputError(f"{out}: output would replace the input model")
    if out.exists() and not overwrite:
        raise InputError(f"{out}: already exists", hint="choose another --out or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    if out.parent.exists() and not out.parent.is_dir():
        raise InputError(f"{out.parent}: not a folder")


def publish(staging: Path, out: Path) -> None:
    """Move a complete staging folder to `out`; an existing `out` is replaced only afterwards."""
    old = out.parent / f".{out.name}.llmq-old"
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def partial_file(path: Path) -> Iterator[Path]:
    """A temporary name next to `path` to write into; renamed to `path` when the block
    succeeds, removed when it fails."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        yield partial
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temporary file, fsync, rename)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write text atomically (temporary file, fsync, rename)."""
    with partial_file(path) as partial, partial.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_safetensors(
    path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """safetensors.save_file, atomically."""
    from safetensors.torch import save_file

    with partial_file(path) as partial:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial), metadata=metadata)
