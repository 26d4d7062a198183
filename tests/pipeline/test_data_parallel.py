"""Data-parallel calibration under torchrun (gloo on the CPU, real processes): two processes,
each on its share of the windows, write what one process writes; a SIGKILLed run resumes to the
uninterrupted run's bytes; a job with nothing to split is refused in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_tiny

pytestmark = pytest.mark.process
CALIBRATION = ["--num-samples", "32", "--seq-len", "128", "--no-reference"]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's own default: one thread a process


def torchrun(processes: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", "-m", "llmq", *args]  # fmt: skip


def quantize(
    model: Path, out: Path, processes: int, *options: str, calibration: list[str] = CALIBRATION
) -> subprocess.CompletedProcess:
    args = ["quantize", str(model), "--out", str(out), "--json", *calibration, *options]
    command = torchrun(processes, *args) if processes > 1 else [sys.executable, "-m", "llmq", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=600)


def kill_everyone_writing(out: Path) -> None:
    """SIGKILL torchrun and its processes (which run in sessions of their own)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue  # gone meanwhile


def stored(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_two_processes_write_what_one_writes(tmp_path: Path, tiny_llama: Path, method: str) -> None:
    """The Hessians and magnitudes reduced over the processes are one process's up to float
    summation order: on 32 x 128 tokens GPTQ's packed codes and scales come out the same here
    (the bound allows 0.5% of the codes to flip, and scales and AWQ's folded norms to move by
    1e-5 relative)."""
    one = quantize(tiny_llama, tmp_path / "one", 1, "--method", method)
    two = quantize(tiny_llama, tmp_path / "two", 2, "--method", method)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    assert json.loads(two.stdout)["calibration"]["tokens"] == 32 * 128  # all windows, split
    want, got = stored(tmp_path / "one"), stored(tmp_path / "two")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        if name.endswith("weight_packed"):
            assert (got[name] == tensor).float().mean() >= 0.995, name
        else:  # scales, and the norms AWQ's scales were folded into
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=0)


def test_a_killed_data_parallel_run_resumes(tmp_path: Path, default_model: Path) -> None:
    """SIGKILL to torchrun and its processes after the first resume point; --resume goes on
    from there in two processes and writes the uninterrupted two-process run's bytes."""
    model = make_tiny(tmp_path / "deep", default_model, layers=6, hidden=384, heads=6, kv_heads=2)
    options = ["--method", "gptq", "--resume-every", "0"]
    whole = quantize(model, tmp_path / "whole", 2, *options)
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "out"
    args = ["quantize", str(model), "--out", str(out), *CALIBRATION, *options]
    run = subprocess.Popen(torchrun(2, *args), env=ENV, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    state = tmp_path / ".out.llmq-partial" / "llmq-state.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        if state.is_file() and json.loads(state.read_text() or "{}").get("layers"):
            kill_everyone_writing(out)
            break
        time.sleep(0.02)
    run.wait(timeout=60)
    assert run.returncode == -signal.SIGKILL and not out.exists()
    resumed = quantize(model, out, 2, *options, "--resume")
    assert resumed.returncode == 0, [
        line for line in resumed.stderr.splitlines() if "error" in line
    ]
    assert 1 <= json.loads(resumed.stdout)["resumed_layers"] < 6
    want, got = stored(tmp_path / "whole"), stored(out)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_what_has_no_windows_to_split_is_refused_in_one_line(
    tmp_path: Path, tiny_llama: Path
) -> None:
    run = quantize(tiny_llama, tmp_path / "out", 2, "--model-free", calibration=[])
    output = run.stdout + run.stderr
    assert output.count("error:") == 1, output[-3000:]
    assert "model-free conversion reads no calibration windows to split" in output
    assert "exitcode  : 2" in output  # process 0's, as torchrun reports it
    assert not (tmp_path / "out").exists()
