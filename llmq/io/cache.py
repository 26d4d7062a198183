"""Entries of llmq's user cache (token ids of texts, baseline perplexities): written whole,
read defensively.

A cache only saves time, so it never stops a run: an entry that cannot be read (a half-written
file from another tool, a truncated copy, an older format) is removed and rebuilt with a
warning, and an entry that cannot be written (a full disk, a read-only cache folder) is skipped
with a warning. Concurrent runs may write the same entry: each writes its own partial file and
the last rename wins, whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

from llmq.io.atomic import partial_file

log = logging.getLogger(__name__)
T = TypeVar("T")


def read_cached(path: Path, load: Callable[[Path], T]) -> T | None:
    """`load(path)`, or None when there is no entry or it is unreadable (then removed)."""
    if not path.is_file():
        return None
    try:
        return load(path)
    except Exception as exc:  # whatever a damaged file makes the parser raise: rebuild it
        log.warning("ignored an unreadable cache entry %s (%s); rebuilding it", path, exc)
        with suppress(OSError):
            path.unlink()
        return None


def write_cached(path: Path, write: Callable[[Path], None]) -> None:
    """`write(partial)` into a temporary name, then rename it to `path`; a failure to write is
    a warning, never an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with partial_file(path) as partial:
            write(partial)
    except OSError as exc:
        log.warning("could not write the cache entry %s (%s); it will be rebuilt next time", path, exc.strerror or exc)  # fmt: skip
