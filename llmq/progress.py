"""How long-running library code reports progress without printing: a protocol the caller
implements (the CLI with Rich bars on stderr); the default does nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

Advance = Callable[[int], None]


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
        yield lambda _steps=1: None


NO_PROGRESS: Progress = NoProgress()
