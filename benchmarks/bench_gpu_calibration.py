"""GPTQ W4A16 g128 at Llama-3-8B shapes on a GPU: llmq and llm-compressor side by side in one run.

Both tools quantize the same random-weight checkpoint (time and memory depend on shapes, not on
weight values) from the same calibration windows: llmq draws them from --calib-text with its own
sampler, and the peer reads exactly those token ids from a safetensors file. Each tool runs in its
own process, measured for wall time, peak resident memory (wait4) and peak GPU memory (the
device's used memory, sampled every 0.2 s, minus what was used before the run). A run that
outlasts --timeout is killed and reported as such, with the layers it had finished.

    python benchmarks/bench_gpu_calibration.py --model DIR --calib-text FILE --out DIR \\
        [--samples 128 --seq-len 2048 --device cuda --timeout 240 --peer-python python3]

benchmarks/gpu_calibration.sh is the prepared call on a lent GPU that runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "common.py"  # run as a script: starts the command, reports its peak RSS
RSS_MARKER = "peak-rss-bytes="
# llm-compressor's sequential pipeline names each subgraph (a layer) it finishes: how far a run
# killed at the limit got. llmq's --json result lists its finished layers itself.
PEER_LAYER_DONE = r"\((\d+/\d+)\): Propagating"


@dataclass
class Row:
    tool: str
    returncode: int | None  # None: killed at the time limit
    wall_s: float
    peak_rss_gb: float | None
    peak_gpu_gb: float | None
    output_gb: float | None
    progress: str | None  # layers (llmq) or subgraphs, one per layer and the head (peer) done
    result: dict | None  # what the tool printed as its result (JSON), its per-layer list summed up
    tail: str


class GpuSampler:
    """The device's peak used memory while a run lasts, above what was used before it."""

    def __init__(self) -> None:
        self.peak = self.base = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def _used() -> int | None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True, text=True, timeout=10,
            ).stdout  # fmt: skip
            return int(out.split()[0]) * 2**20
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None  # no NVIDIA GPU here

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            used = self._used()
            if used is not None and self.peak is not None:
                self.peak = max(self.peak, used)

    def __enter__(self) -> GpuSampler:
        if self.base is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak_gb(self) -> float | None:
        if self.base is None or self.peak is None:
            return None
        return round((self.peak - self.base) / 1e9, 2)


def run_measured(tool: str, cmd: list[str], log: Path, timeout: float, extra_env: dict) -> Row:
    """Run cmd in its own process group (killed whole at the limit); stdout+stderr go to log."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **extra_env}  # fmt: skip
    started = time.perf_counter()
    with GpuSampler() as gpu, log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(LAUNCHER), *cmd], stdout=sink, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    wall = time.perf_counter() - started
    text = log.read_text(errors="replace")
    rss = re.findall(rf"^{RSS_MARKER}(\d+)$", text, flags=re.M)
    result = tool_result(text)
    peer_steps = re.findall(PEER_LAYER_DONE, text)
    return Row(
        tool=tool,
        returncode=returncode,
        wall_s=round(wall, 1),
        peak_rss_gb=round(int(rss[-1]) / 1e9, 2) if rss else None,
        peak_gpu_gb=gpu.peak_gb(),
        output_gb=None,
        progress=f"{len(result['layer_seconds'])} layers"
        if result and "layer_seconds" in result
        else (f"{peer_steps[-1]} subgraphs" if peer_steps else None),
        result=result,
        tail=text[-1500:],
    )


def tool_result(text: str) -> dict | None:
    """The result JSON in a run's log: llmq's (indented, from a line '{' to a line '}') or the
    peer runner's one line; llmq's per-layer records shortened to their seconds."""
    found = re.search(r"^\{\n.*?^\}$", text, flags=re.M | re.S) or re.search(
        r'^\{"tool".*\}$', text, flags=re.M
    )
    if found is None:
        return None
    result = json.loads(found.group(0))
    if isinstance(result.get("layers"), list):
        result["layer_seconds"] = [round(layer["seconds"], 2) for layer in result.pop("layers")]
    return result


def folder_gb(path: Path) -> float | None:
    if not path.is_dir():
        return None
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9, 3)


def write_calibration(model: Path, text: str, samples: int, seq_len: int, path: Path) -> None:
    """llmq's own windows (seed 0) as the int64 `input_ids` the peer runner reads."""
    from safetensors.torch import save_file

    from llmq.calib.data import calibration_windows
    from llmq.calib.tokenizer import load_tokenizer

    windows = calibration_windows(
        load_tokenizer(model), text, num_samples=samples, seq_len=seq_len, seed=0
    )
    save_file({"input_ids": windows.input_ids.contiguous()}, str(path))


@dataclass(frozen=True)
class Run:
    label: str
    cmd: list[str]
    env: dict[str, str]


def runs(args: argparse.Namespace, calib: Path) -> list[Run]:
    """llmq with its defaults (TF32 products, stage activations kept where they fit), the peer,
    then llmq holding one copy of the activations (`--stage-activations recompute`) and llmq
    in true float32 (`--no-tf32`)."""
    llmq = [
        sys.executable, "-m", "llmq.cli.main", "quantize", str(args.model),
        "--out", str(args.out / "out"), "--scheme", "w4a16", "--method", "gptq",
        "--calib-text", args.calib_text, "--num-samples", str(args.samples),
        "--seq-len", str(args.seq_len), "--seed", "0", "--device", args.device,
        "--no-reference", "--json",
    ]  # fmt: skip
    peer = [
        args.peer_python, str(HERE / "peers" / "llmcompressor_quantize.py"),
        "--model", str(args.model), "--out", str(args.out / "out"),
        "--scheme", "W4A16", "--method", "gptq", "--calib", str(calib), "--dtype", "auto",
    ]  # fmt: skip
    return [
        Run("llmq", llmq, {}),
        Run("llm-compressor", peer, {}),
        Run("llmq-recompute", [*llmq, "--stage-activations", "recompute"], {}),
        Run("llmq-fp32", [*llmq, "--no-tf32"], {}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--calib-text", required=True, help="a .txt file (or a built-in text)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per tool")
    parser.add_argument("--peer-python", default=sys.executable)
    parser.add_argument("--only", nargs="+", help="run only the rows with these labels")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calib = args.out / "calib.safetensors"
    write_calibration(args.model, args.calib_text, args.samples, args.seq_len, calib)
    rows = []
    for run in runs(args, calib):
        if args.only and run.label not in args.only:
            continue
        print(f"== {run.label}: {' '.join(run.cmd)} {run.env or ''}", flush=True)
        row = run_measured(run.label, run.cmd, args.out / f"{run.label}.log", args.timeout, run.env)
        row.output_gb = folder_gb(args.out / "out")
        print(json.dumps({k: v for k, v in asdict(row).items() if k not in ("tail", "result")}))
        print(json.dumps(row.result), flush=True)
        if row.returncode != 0:
            print(row.tail, flush=True)
        shutil.rmtree(args.out / "out", ignore_errors=True)  # the disk holds one output at a time
        rows.append(asdict(row))
    config = json.loads((args.model / "config.json").read_text())
    report = {
        "model": {k: config.get(k) for k in ("hidden_size", "intermediate_size",
                                              "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "vocab_size")},
        "calibration": f"{args.samples} x {args.seq_len} tokens of {args.calib_text}, seed 0",
        "device": args.device,
        "rows": rows,
    }  # fmt: skip
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["model"]), flush=True)


if __name__ == "__main__":
    main()
