"""What a command writes when its output goes to a log (CI), not a terminal: a plain progress
line every interval while it works, and tables as wide as their content."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cli.test_output_safety import llmq_cmd

pytestmark = pytest.mark.process

PROGRESS_LINE = re.compile(r"^\d+:\d\d:\d\d \S.*$")


def test_a_long_command_prints_progress_lines_to_a_log(tmp_path: Path, tiny_llama: Path) -> None:
    env = {**os.environ, "LLMQ_PROGRESS_INTERVAL": "0.2"}
    run = subprocess.run(
        llmq_cmd("quantize", str(tiny_llama), "--out", str(tmp_path / "q"), "--scheme", "w4a16",
                 "--method", "gptq", "--num-samples", "8", "--seq-len", "128", "--json"),
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if PROGRESS_LINE.match(line)]
    assert lines, run.stderr
    # The open stages with their counts, innermost last: the layer loop and a layer's passes.
    assert any(re.search(r"layers? \d+/2", line) for line in lines), lines
    assert "\x1b[" not in run.stderr  # no terminal escapes in a log
    assert run.stdout.lstrip().startswith("{")  # --json stays clean: progress goes to stderr


def test_a_short_command_prints_nothing_to_a_log(tmp_path: Path) -> None:
    run = subprocess.run(llmq_cmd("models"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == ""


def test_tables_in_a_log_are_not_cut_at_80_columns(tmp_path: Path, tiny_llama: Path) -> None:
    names = [tmp_path / "a-checkpoint-with-a-long-descriptive-name-one", tmp_path / "a-checkpoint-with-a-long-descriptive-name-two"]  # fmt: skip
    for name in names:
        shutil.copytree(tiny_llama, name)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    run = subprocess.run(
        llmq_cmd("eval", *map(str, names), "--eval-windows", "1", "--seq-len", "32"),
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    for name in names:
        assert name.name in run.stdout, run.stdout
    assert "…" not in run.stdout
