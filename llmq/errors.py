"""The errors llmq raises. The library raises; only `llmq.cli` maps them to exit codes.

Exit codes: 0 ok, 1 a gate failed (`GateFailed`), 2 bad input or an unsupported model.
"""

from __future__ import annotations


class LlmqError(Exception):
    """Base error: one line saying what failed and where, and optionally what to try."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class InputError(LlmqError):
    """Bad input: a missing or corrupt file, an out-of-range option, an existing output."""


class UnsupportedModelError(LlmqError):
    """A checkpoint whose architecture llmq has no layer table for."""


class NumericalError(LlmqError):
    """NaN or Inf appeared while quantizing; the message names the layer."""


class GateFailed(LlmqError):
    """An accuracy gate was exceeded (exit code 1)."""

    exit_code = 1


class OutputError(LlmqError):
    """An output could not be written: no space, read-only, no permission, a path that cannot
    be created (exit 2). The message names the path; the hint says what to try."""
