"""Refactoring changes no byte: the files each method writes for the default model (small
calibration) hash as they did when recorded (tests/golden.json, first from main dd5016e).

An intended change of output is recorded again with `python tests/test_golden.py [CASE ...]`
(all cases, or those named) and named in the commit message. Byte identity is only expected with the torch version the hashes were
recorded with: with another one the test is skipped, saying so. The data-free cases run in every
suite; the calibrated ones take about 25 CPU-minutes together, so they run when LLMQ_GOLDEN=1
(before and after a change to the pipeline, quantizers or writers: docs/tests.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).with_name("golden.json")
CALIBRATION = ["--num-samples", "4", "--seq-len", "128"]
CASES: dict[str, list[str]] = {
    # the layer pipeline's bytes (its one-window check reads no more than it reports)
    "rtn-w4a16": ["quantize", "--scheme", "w4a16", "--method", "rtn", "--no-model-free"],
    "gptq-w4a16-g64": [
        "quantize",
        "--scheme",
        "w4a16",
        "--group-size",
        "64",
        "--method",
        "gptq",
        *CALIBRATION,
    ],
    "awq-w4a16": ["quantize", "--scheme", "w4a16", "--method", "awq", *CALIBRATION],
    "smoothquant-gptq-w8a8": [
        "quantize",
        "--scheme",
        "w8a8",
        "--method",
        "gptq",
        "--smooth",
        "auto",
        *CALIBRATION,
    ],
    "fp8-block": ["quantize", "--scheme", "fp8-block", "--no-model-free"],
    # model-free conversion, the default for these: its own shards, the same tensors
    "model-free-w4a16": ["quantize", "--scheme", "w4a16"],
    "model-free-fp8-block": ["quantize", "--scheme", "fp8-block"],
    "wanda-50": ["prune", "--method", "wanda", "--sparsity", "0.5", *CALIBRATION],
    "sparsegpt-2of4": ["prune", "--method", "sparsegpt", "--pattern", "2:4", *CALIBRATION],
}
DATA_FREE = ("rtn-w4a16", "fp8-block", "model-free-w4a16", "model-free-fp8-block")
RECORD_FILE = "llmq.json"  # how and when it was made: not part of the checkpoint's bytes


def cpu_model() -> str:
    """This machine's CPU model name. A calibrated case's bytes are the machine's: its BLAS
    sums a Hessian in an order of its own, which flips a few rounding decisions (measured: an
    AMD EPYC writes other GPTQ, AWQ, SparseGPT and Wanda files than the Intel machine the
    hashes were first recorded on, from the same commit). So golden.json holds those cases'
    hashes per CPU (`by_cpu`), besides the first machine's (`cases`)."""
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    import platform

    return platform.processor() or "unknown"


def expected(golden: dict, case: str) -> dict[str, str]:
    """CASE's recorded hashes: this CPU's where golden.json has them (calibrated cases)."""
    return golden.get("by_cpu", {}).get(cpu_model(), {}).get(case, golden["cases"][case])


def written(case: str, out: Path) -> dict[str, str]:
    """Write CASE's checkpoint of the default model at OUT; the SHA-256 of every file in it."""
    command, *options = CASES[case]
    args = [command, "smollm2-135m", "--out", str(out), "--no-reference", *options]
    run = subprocess.run([sys.executable, "-m", "llmq.cli.main", *args], capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(out.iterdir())
        if path.is_file() and path.name != RECORD_FILE
    }


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.process
def test_the_files_written_are_unchanged(case: str, tmp_path: Path, default_model: Path) -> None:
    import torch

    if case not in DATA_FREE and os.environ.get("LLMQ_GOLDEN") != "1":
        pytest.skip("a calibrated golden case: LLMQ_GOLDEN=1 runs it (minutes each)")
    golden = json.loads(GOLDEN.read_text())
    if golden["torch"] != torch.__version__:
        pytest.skip(f"hashes recorded with torch {golden['torch']}, this is {torch.__version__}")
    assert written(case, tmp_path / case) == expected(golden, case)


def record(folder: Path, only: list[str], *, this_cpu: bool = False) -> None:
    """Record every case's hashes again, or only the cases named (the others kept as they
    are); `this_cpu`: the calibrated cases, as this CPU writes them (`by_cpu`)."""
    import torch

    golden = json.loads(GOLDEN.read_text()) if only or this_cpu else {"cases": {}}
    if (only or this_cpu) and golden["torch"] != torch.__version__:
        raise SystemExit(f"the other cases were recorded with torch {golden['torch']}: record all")
    names = only or sorted(set(CASES) - set(DATA_FREE) if this_cpu else CASES)
    hashes = {case: written(case, folder / case) for case in names}
    by_cpu = golden.get("by_cpu", {})
    if this_cpu:
        by_cpu[cpu_model()] = dict(sorted({**by_cpu.get(cpu_model(), {}), **hashes}.items()))
    else:
        golden["cases"] = dict(sorted({**golden["cases"], **hashes}.items()))
    recorded = {"torch": torch.__version__, "cases": golden["cases"], **({"by_cpu": by_cpu} if by_cpu else {})}  # fmt: skip
    GOLDEN.write_text(json.dumps(recorded, indent=2) + "\n")


if __name__ == "__main__":
    import tempfile

    arguments = sys.argv[1:]
    with tempfile.TemporaryDirectory() as scratch:
        record(
            Path(scratch),
            [a for a in arguments if a != "--this-cpu"],
            this_cpu="--this-cpu" in arguments,
        )
