"""Ask the kernel to read files into the page cache before the work reaches them.

A converter that maps its source files reads them by page faults: each worker waits for the
disk, then computes, then waits again, so a cold read and the arithmetic add up instead of
overlapping. `ReadAhead` hands the byte ranges of the next stretch of work to the kernel
(`posix_fadvise(WILLNEED)`) from a thread of its own (the call can block while the reads are
queued), so the disk reads while the workers compute. It is advice: the pages are the page
cache's, which the kernel can drop under memory pressure, and where the call does not exist
(macOS) or fails nothing happens but the reads at first use.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

FileRange = tuple[Path, int, int]  # file, first byte, byte count


class ReadAhead:
    """A context: `advise(ranges)` queues ranges to be read ahead, in order; leaving drops
    what is still queued."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="llmq-readahead")

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def advise(self, ranges: list[FileRange]) -> None:
        if hasattr(os, "posix_fadvise") and ranges:
            self._thread.submit(_advise, ranges)


def _advise(ranges: list[FileRange]) -> None:
    handles: dict[Path, int] = {}
    try:
        for path, start, length in ranges:
            if path not in handles:
                handles[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(handles[path], start, length, os.POSIX_FADV_WILLNEED)
    except OSError as exc:  # advice only: the reads at first use will say what is wrong
        log.debug("read-ahead stopped: %s", exc)
    finally:
        for handle in handles.values():
            os.close(handle)
