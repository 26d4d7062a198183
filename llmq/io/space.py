"""Room for an output: refuse before any work when it cannot fit on its file system."""

from __future__ import annotations

import shutil
from pathlib import Path

from llmq.errors import OutputError


def check_free_space(out: Path, needed: int) -> None:
    """Refuse when `needed` bytes will not fit on the file system that holds `out`."""
    folder = _existing_ancestor(out)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise OutputError(
            f"{out}: needs about {_size(needed)}, but {folder} has {_size(free)} free",
            hint="free some space or choose another --out; --no-space-check skips this check "
            "on file systems that report free space wrongly",
        )


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def folder_size(folder: Path) -> int:
    """Bytes of the files directly in `folder` (0 when it does not exist)."""
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
