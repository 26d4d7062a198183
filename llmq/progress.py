"""How long-running library code reports progress without printing: a protocol the caller
implements (the CLI with Rich bars on stderr); the default does nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol


class Advance(Protocol):
    def __call__(self, steps: int = 1, status: str | None = None) -> None:
        """Move the stage on by `steps`; `status` (loss, speed, ...) replaces the last one."""
        ...


class Progress(Protocol):
    def stage(
        self, description: str, total: int | None = None, *, transient: bool = False
    ) -> AbstractContextManager[Advance]:
        """A unit of work of `total` steps; the context yields a function advancing it."""
        ...


class NoProgress:
    """Reports nothing."""

    @contextmanager
    def stage(
        self, description: str, total: int | None = None, *, transient: bool = False
    ) -> Iterator[Advance]:
        yield lambda steps=1, status=None: None


NO_PROGRESS: Progress = NoProgress()
