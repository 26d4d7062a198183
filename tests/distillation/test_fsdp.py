"""`distill --sharding fsdp` (FSDP2) in real gloo processes: pruning masks on sharded rows, a
resume point written by every process, and a run killed by SIGKILL that resumes to the very
student and losses of an uninterrupted one; bad input."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmq.cli.main import app
from tests.conftest import assert_bad_input
from tests.distillation.test_distill import GLOO_ENV, REPO, assert_same_weights, torchrun, weights

runner = CliRunner()


def kill_every_process_naming(fragment: str) -> None:
    """SIGKILL every process whose command line contains `fragment`: torchrun starts its
    workers in sessions of their own, so killing its process group misses them."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        if fragment in command:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


@pytest.mark.process
def test_a_killed_fsdp_run_resumes_to_the_uninterrupted_student(
    tmp_path: Path, teacher: Path, student: Path
) -> None:
    args = ["--teacher", str(teacher), "--student", str(student), "--seq-len", "64",
            "--batch-size", "1", "--grad-accum", "1", "--eval-windows", "3", "--no-evaluate",
            "--no-reference", "--max-steps", "6", "--lr", "1e-3", "--checkpoint-every", "2",
            "--keep", "last", "--sharding", "fsdp", "--prune", "gmp", "--prune-method", "wanda",
            "--sparsity", "0.5", "--prune-end", "4", "--json"]  # fmt: skip
    whole = subprocess.run([*torchrun(), *args, "--out", str(tmp_path / "whole")], cwd=REPO, capture_output=True, text=True, env=GLOO_ENV)  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "killed"
    point = tmp_path / ".killed.llmq-partial" / ".distill"
    proc = subprocess.Popen([*torchrun(), *args, "--out", str(out)], cwd=REPO, env=GLOO_ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 180
    while not (point / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    kill_every_process_naming(str(out))  # torchrun and both workers
    proc.wait()
    assert not out.exists()
    assert sorted(p.name for p in (point / "step-0000002" / "sharded").iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]  # fmt: skip
    done = subprocess.run([*torchrun(), *args, "--out", str(out), "--resume"], cwd=REPO, capture_output=True, text=True, env=GLOO_ENV)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["losses"] == json.loads(whole.stdout)["losses"]
    assert_same_weights(tmp_path / "whole", out)
    q = weights(out)["model.layers.0.self_attn.q_proj.weight"]
    assert ((q == 0).sum(dim=1) == q.shape[1] // 2).all(), "every row, on both processes"
    assert json.loads(whole.stdout)["sparsity"] == pytest.approx(0.5)
    assert torch.isfinite(q).all()


def test_fsdp_needs_several_processes(tmp_path: Path, teacher: Path, student: Path) -> None:
    base = ["distill", "--teacher", str(teacher), "--student", str(student), "--out", str(tmp_path / "o"), "--max-steps", "2"]  # fmt: skip
    assert_bad_input(runner.invoke(app, [*base, "--sharding", "fsdp"]), "this run has one")
    assert_bad_input(runner.invoke(app, [*base, "--sharding", "zero3"]), "--sharding 'zero3'")
    assert not (tmp_path / "o").exists()
