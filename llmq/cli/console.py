"""Consoles, progress bars and error rendering shared by the commands.

Diagnostics and progress go to stderr; results (tables or --json) go to stdout. Library errors
become `error:` / `hint:` lines and exit codes: 1 a gate failed, 2 bad input or usage.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichBars
from rich.text import Text

from llmq.errors import InputError, LlmqError

# No markup: printed text holds paths, tensor names and messages, where Rich would read `[x]`
# as a style tag and drop it; styled words are built with `labelled`.
out_console = Console(highlight=False, markup=False)
err_console = Console(stderr=True, highlight=False, markup=False)
LOG_WIDTH = 200  # tables written to a file or pipe are not cut to 80 columns
LOG_INTERVAL_S = 30.0  # seconds between progress lines when stderr is a log
if not out_console.is_terminal and "COLUMNS" not in os.environ:
    out_console.width = LOG_WIDTH


def counted(count: int, noun: str) -> str:
    """`count` and `noun`, plural unless the count is one: 1 tensor, 2 tensors."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def labelled(label: str, style: str, text: str = "") -> Text:
    """`label` in `style`, then `text` as it is."""
    return Text.assemble((label, style), f" {text}" if text else "")


def print_error(message: str, hint: str | None = None) -> None:
    err_console.print(labelled("error:", "bold red", message), soft_wrap=True)
    if hint:
        err_console.print(Text("  ") + labelled("hint:", "bold", hint), soft_wrap=True)


class _WarningLines(logging.Handler):
    """The library's log records (logging, never print) as lines on stderr: warnings as
    `warning:`, information the user should see (a resumed run's starting point) as `note:`."""

    def emit(self, record: logging.LogRecord) -> None:
        label = ("warning:", "bold yellow") if record.levelno >= logging.WARNING else ("note:", "bold")  # fmt: skip
        err_console.print(labelled(*label, record.getMessage()), soft_wrap=True)


def show_warnings() -> None:
    """Route llmq's log warnings and notes to stderr lines, once per process."""
    logger = logging.getLogger("llmq")
    logger.setLevel(logging.INFO)
    if not any(isinstance(h, _WarningLines) for h in logger.handlers):
        handler = _WarningLines(logging.INFO)
        logger.addHandler(handler)


def quiet_libraries() -> None:
    """No hub calls (llmq reads local folders) and no third-party progress bars or chatter;
    llmq's own warnings shown as `warning:` lines.

    Environment variables only: importing datasets here would cost a second on every command."""
    show_warnings()
    for name, value in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "DATASETS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
        "TQDM_DISABLE": "1",  # lm-eval's and datasets' bars: llmq draws its own
    }.items():
        os.environ.setdefault(name, value)
    logging.getLogger("lm-eval").setLevel(logging.ERROR)  # its notices about models passed in
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


class RichProgress:
    """llmq.progress.Progress drawn with Rich on stderr: one bar per stage, inner ones transient."""

    def __init__(self, *, enabled: bool) -> None:
        self.bars = RichBars(
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err_console,
            disable=not enabled,
        )

    @contextmanager
    def stage(
        self, description: str, total: int | None = None, *, transient: bool = False
    ) -> Iterator[Any]:
        task = self.bars.add_task(description, total=total)

        def advance(steps: int = 1, status: str | None = None) -> None:
            if status is not None:
                self.bars.update(task, description=f"{description} · {status}")
            self.bars.advance(task, steps)

        try:
            yield advance
        finally:
            if transient:
                self.bars.remove_task(task)


class LineProgress:
    """llmq.progress.Progress for logs (stderr not a terminal, as in CI): every `interval`
    seconds a stage is open, one plain line on stderr with the elapsed time and the open stages
    with their counts, innermost last (`0:02:30 quantize 3/30 > layer 3 64/128`). A command that
    ends within the interval prints nothing."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.started = time.monotonic()
        self.open: list[_Stage] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.beat = threading.Thread(target=self._beat, name="llmq-progress", daemon=True)

    @contextmanager
    def stage(
        self, description: str, total: int | None = None, *, transient: bool = False
    ) -> Iterator[Any]:
        stage = _Stage(description, total)
        with self.lock:
            self.open.append(stage)

        def advance(steps: int = 1, status: str | None = None) -> None:
            stage.done += steps
            if status is not None:
                stage.status = status

        try:
            yield advance
        finally:
            with self.lock:
                self.open.remove(stage)

    def line(self) -> str:
        elapsed = int(time.monotonic() - self.started)
        with self.lock:
            stages = " > ".join(stage.describe() for stage in self.open)
        return f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d} {stages}"

    def _beat(self) -> None:
        while not self.stopped.wait(self.interval):
            if self.open:
                err_console.print(self.line(), soft_wrap=True, highlight=False)

    def __enter__(self) -> LineProgress:
        self.beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.beat.join()


class _Stage:
    def __init__(self, description: str, total: int | None) -> None:
        self.description = description
        self.total = total
        self.done = 0
        self.status: str | None = None

    def describe(self) -> str:
        count = f" {self.done}/{self.total}" if self.total is not None else ""
        status = f" ({self.status})" if self.status else ""
        return f"{self.description}{count}{status}"


def log_interval() -> float:
    """Seconds between progress lines in logs: LLMQ_PROGRESS_INTERVAL, default 30."""
    try:
        return max(0.1, float(os.environ.get("LLMQ_PROGRESS_INTERVAL", LOG_INTERVAL_S)))
    except ValueError:
        return LOG_INTERVAL_S


@contextmanager
def progress_bars(*, json_out: bool) -> Iterator[RichProgress | LineProgress]:
    """Rich bars on a terminal (none with --json), plain periodic lines in a log."""
    if not err_console.is_terminal:
        with LineProgress(log_interval()) as lines:
            yield lines
        return
    progress = RichProgress(enabled=not json_out)
    with progress.bars:
        yield progress


@contextmanager
def cli_errors() -> Iterator[None]:
    """Turn llmq errors, and any I/O failure, into one `error:` line (plus `hint:`) and their
    exit code: never a traceback."""
    try:
        yield
    except LlmqError as exc:
        print_error(exc.message, exc.hint)
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:  # an I/O failure no command turned into an OutputError itself
        from llmq.io.atomic import output_error

        error = output_error(exc)
        print_error(error.message, error.hint)
        raise typer.Exit(error.exit_code) from None
    except KeyboardInterrupt:
        err_console.print(labelled("interrupted", "bold red"))
        raise typer.Exit(130) from None


@contextmanager
def resume_hint_on_interrupt(out: Any) -> Iterator[None]:
    """On Ctrl-C, say how to continue the interrupted run into `out`."""
    try:
        yield
    except KeyboardInterrupt:
        err_console.print(f"partial output kept; continue with: --out {out} --resume")
        raise


def speaks_for_all() -> bool:
    """Whether this process reports: one alone, or torchrun's process 0, which speaks for the
    others (they stay silent, errors included: each would say the same)."""
    from llmq.processes import launched

    if launched().is_main:
        return True
    out_console.quiet = err_console.quiet = True
    return False


def print_json(data: Any) -> None:
    """Machine-readable output on stdout, nothing else."""
    typer.echo(json.dumps(data, indent=2, default=str))


def parse_fraction(text: str | None, option: str) -> float | None:
    """'3%' -> 0.03, '0.03' -> 0.03."""
    if text is None:
        return None
    try:
        value = float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise InputError(
            f"{option} {text!r}: expected a percentage like 3% or a fraction like 0.03"
        ) from None
    return value
