"""Shared benchmark plumbing: measured subprocesses, the peer's environment, perplexity tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_PYTHON = HERE / ".venvs" / "llmcompressor" / "bin" / "python"
PEER_RUNNER = HERE / "peers" / "llmcompressor_quantize.py"


@dataclass(frozen=True)
class Measured:
    wall_s: float
    peak_rss_bytes: int
    stdout: str


def run_measured(cmd: list[str]) -> Measured:
    """Run cmd; its wall time and peak resident set size (wait4's rusage of that child)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.stderr.write(stderr[-4000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return Measured(wall, usage.ru_maxrss * 1024, stdout)


def ensure_peer() -> None:
    subprocess.run(["bash", str(HERE / "peers" / "setup_llmcompressor.sh")], check=True)


def llmq_quantize_cmd(model: Path, out: Path, options: list[str]) -> list[str]:
    return [sys.executable, "-m", "llmq.cli.main", "quantize", str(model), "--out", str(out),
            "--overwrite", "--json", *options]  # fmt: skip


def peer_quantize_cmd(model: Path, out: Path, options: list[str]) -> list[str]:
    return [str(PEER_PYTHON), str(PEER_RUNNER), "--model", str(model), "--out", str(out), *options]


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
