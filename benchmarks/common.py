"""Shared benchmark plumbing: measured subprocesses, the peer's environment, perplexity tables."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LLMQ, PEER = "llmq", "llm-compressor"
HERE = Path(__file__).resolve().parent
PEER_PYTHON = HERE / ".venvs" / "llmcompressor" / "bin" / "python"


@dataclass(frozen=True)
class Job:
    """One quantization (or pruning) run of a side-by-side benchmark."""

    tool: str  # LLMQ or PEER
    label: str
    options: list[str]
    calib: str | None = None  # which shared calibration windows it reads; None: data-free
    compare_with: str | None = None  # label of the peer row this llmq row is held against
    baseline: str | None = None  # label of the llmq row this one is a variant of

    @property
    def folder(self) -> str:
        return "-".join(f"{self.tool} {self.label}".replace("+", "plus").replace(",", "").split())


@dataclass(frozen=True)
class Measured:
    wall_s: float
    peak_rss_bytes: int
    stdout: str


def run_measured(cmd: list[str]) -> Measured:
    """Run cmd; its wall time and peak resident set size.

    Linux counts the RSS a child inherits at fork in its ru_maxrss, so a command forked from this
    (large) process would report at least our own peak. It is therefore started by a small
    launcher (this file run as a script), whose fresh child reports its own peak only."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    launcher = [sys.executable, str(Path(__file__).resolve()), *cmd]
    started = time.perf_counter()
    done = subprocess.run(launcher, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}")
    marker = done.stderr.strip().splitlines()[-1]
    return Measured(wall, int(marker.removeprefix(_RSS_MARKER)), done.stdout)


_RSS_MARKER = "peak-rss-bytes="


def _launch(cmd: list[str]) -> int:
    """Run cmd as our child and report its peak RSS (from wait4) as the last stderr line."""
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    sys.stderr.write(f"\n{_RSS_MARKER}{usage.ru_maxrss * 1024}\n")
    return os.waitstatus_to_exitcode(status)


def ensure_peer() -> None:
    subprocess.run(["bash", str(HERE / "peers" / "setup_llmcompressor.sh")], check=True)


Command = Callable[[Path, Path, list[str]], list[str]]  # (model, out, options) -> argv


def _llmq_cmd(verb: str, model: Path, out: Path, options: list[str]) -> list[str]:
    return [sys.executable, "-m", "llmq.cli.main", verb, str(model), "--out", str(out),
            "--overwrite", "--json", *options]  # fmt: skip


def _peer_cmd(runner: str, model: Path, out: Path, options: list[str]) -> list[str]:
    """The peer runner benchmarks/peers/`runner`, in the peer's environment."""
    script = HERE / "peers" / runner
    return [str(PEER_PYTHON), str(script), "--model", str(model), "--out", str(out), *options]


def llmq_quantize_cmd(model: Path, out: Path, options: list[str]) -> list[str]:
    return _llmq_cmd("quantize", model, out, options)


def peer_quantize_cmd(model: Path, out: Path, options: list[str]) -> list[str]:
    return _peer_cmd("llmcompressor_quantize.py", model, out, options)


def llmq_prune_cmd(model: Path, out: Path, options: list[str]) -> list[str]:
    return _llmq_cmd("prune", model, out, options)


def peer_prune_cmd(model: Path, out: Path, options: list[str]) -> list[str]:
    return _peer_cmd("llmcompressor_prune.py", model, out, options)


TEXTS = ("pydoc", "shakespeare")  # held-out splits: last quarter of pydoc topics; Hamlet


def held_out_perplexity(
    out: Path, model: Path, windows: int, texts: tuple[str, ...] = TEXTS
) -> dict[str, dict]:
    """llmq's perplexity of checkpoint `out` (either tool's) and of the fp32 `model` on the
    held-out windows of each text; activations quantized per token where the scheme says."""
    import llmq

    ppl = {}
    for text in texts:
        result = llmq.evaluate(out, baseline=model, text=text, max_windows=windows)
        ppl[text] = {"ppl": result.model.perplexity, "base": result.baseline.perplexity,
                     "increase": result.increase, "simulated": result.model.quantized}  # fmt: skip
    return ppl


def job_arguments(doc: str, out: str, *, samples: int = 128) -> argparse.Namespace:
    """The options every side-by-side benchmark takes: held-out windows, calibration size, the
    output folder and a label filter."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=12, help="512-token windows per text")
    parser.add_argument("--samples", type=int, default=samples, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out") / out)
    parser.add_argument("--only", default=None, help="run only jobs whose tool and label ('llmq GPTQ ...') contain one of these ('|'-separated)")  # fmt: skip
    return parser.parse_args()


def protocol(windows: int, texts: tuple[str, ...] = TEXTS) -> str:
    return (
        f"token perplexity, held-out {', '.join(texts)} (Hamlet), {windows} x 512 tokens from "
        "the start, no BOS, float32; activations quantized per token where the scheme does"
    )


def machine() -> str:
    import platform

    return f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, CPU"


def save_report(
    out: Path,
    rows: list[dict],
    windows: int,
    markdown: Callable[[dict], str],
    texts: tuple[str, ...] = TEXTS,
    **extra: str,
) -> None:
    """results.json under `out`, and the markdown tables on stdout."""
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "protocol": protocol(windows, texts), **extra, "rows": rows}  # fmt: skip
    write_json(out / "results.json", report)
    print(markdown(report))


TEXT_NAMES = {"pydoc": "pydoc", "news": "news", "shakespeare": "Hamlet"}


def preamble(report: dict, calibration: str = "Calibration", texts: tuple[str, ...] = TEXTS) -> str:
    """The line above a results table: protocol, calibration (when the report has one) and the
    fp32 baselines of the held-out texts."""
    base = report["rows"][0]["ppl"]
    calib = f" {calibration}: {report['calibration']}." if report.get("calibration") else ""
    baselines = ", ".join(f"{TEXT_NAMES[t]} {base[t]['base']:.3f}" for t in texts)
    return f"Protocol: {report['protocol']}.{calib} fp32 baseline: {baselines}."


def ppl_table(report: dict, first_column: str) -> str:
    """The preamble, then one row per job: its label, the held-out perplexities and wall time."""
    lines = [
        preamble(report),
        "",
        f"| {first_column} | ppl held-out pydoc | ppl Hamlet | wall s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['label']} | {ppl_cells(r)} | {r['wall_s']:.1f} |" for r in report["rows"]]
    return "\n".join(lines)


def ppl_cells(row: dict, texts: tuple[str, ...] = TEXTS) -> str:
    """'ppl (increase) | ppl (increase)' for the held-out texts of one result row."""
    return " | ".join(
        f"{row['ppl'][text]['ppl']:.3f} ({row['ppl'][text]['increase']:+.2%})" for text in texts
    )


@dataclass(frozen=True)
class CalibSet:
    """Calibration windows both tools read: the file handed to the peer, and the llmq options
    that sample exactly the same windows."""

    file: Path
    llmq_options: list[str]


def calibration_set(model: Path, path: Path, samples: int, seq_len: int) -> CalibSet:
    """Write llmq's pydoc calibration windows (seed 0) to `path` for the peer."""
    from safetensors.torch import save_file

    from llmq.calib.data import calibration_windows
    from llmq.calib.tokenizer import load_tokenizer

    windows = calibration_windows(
        load_tokenizer(model), "pydoc", num_samples=samples, seq_len=seq_len, seed=0
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": windows.input_ids.contiguous()}, str(path))
    options = ["--calib-text", "pydoc", "--num-samples", str(samples), "--seq-len", str(seq_len),
               "--seed", "0"]  # fmt: skip
    return CalibSet(path, options)


def run_jobs(
    jobs: list[Job],
    model: Path,
    out: Path,
    calib: dict[str, CalibSet],
    *,
    windows: int,
    only: str | None,
    commands: tuple[Command, Command] = (llmq_quantize_cmd, peer_quantize_cmd),
    texts: tuple[str, ...] = TEXTS,
) -> list[dict]:
    """Run each job (those whose tool and label, "llmq GPTQ W4A16 g64 ...", contain one of the
    '|'-separated parts of `only`, when given) in its own measured process, and score its checkpoint: one result row per job.
    `commands`: llmq's and the peer's command lines (quantize by default)."""
    import llmq

    llmq_cmd, peer_cmd = commands
    # Warm llmq's token cache and the page cache of the model file outside the timed runs.
    llmq.quantize(model, out / "warmup", scheme="w8a16", overwrite=True)
    rows = []
    for job in jobs:
        if only is not None and not any(part in f"{job.tool} {job.label}" for part in only.split("|")):  # fmt: skip
            continue
        folder = out / job.folder
        options = list(job.options)
        if job.calib is not None:
            shared = calib[job.calib]
            options += shared.llmq_options if job.tool == LLMQ else ["--calib", str(shared.file)]
        cmd = (llmq_cmd if job.tool == LLMQ else peer_cmd)(model, folder, options)
        measured = run_measured(cmd)
        rows.append({"tool": job.tool, "label": job.label, "compare_with": job.compare_with,
                     "baseline": job.baseline, "options": options,
                     "wall_s": measured.wall_s, "peak_rss_gb": measured.peak_rss_bytes / 1e9,
                     "ppl": held_out_perplexity(folder, model, windows, texts)})  # fmt: skip
        print(f"done: {job.tool} {job.label}: {measured.wall_s:.1f} s", file=sys.stderr, flush=True)
    return rows


def peer_comparison(rows: list[dict], texts: tuple[str, ...] = TEXTS) -> list[str]:
    """Markdown rows: each llmq row against the peer row it names (time, memory, accuracy)."""
    lines = ["| llmq row | vs peer row | llmq/peer wall | llmq/peer peak RSS | "
             + " | ".join(f"increase {TEXT_NAMES[t]} llmq vs peer" for t in texts) + " |",
             "|---|---|---|---|" + "---|" * len(texts)]  # fmt: skip
    peers = {r["label"]: r for r in rows if r["tool"] == PEER}
    for r in rows:
        peer = peers.get(r["compare_with"] or "")
        if r["tool"] != LLMQ or peer is None:
            continue
        increases = [
            f"{r['ppl'][text]['increase']:+.2%} vs {peer['ppl'][text]['increase']:+.2%}"
            for text in texts
        ]
        lines.append(
            f"| {r['label']} | {peer['label']} | {r['wall_s'] / peer['wall_s']:.2f}x | "
            f"{r['peak_rss_gb'] / peer['peak_rss_gb']:.2f}x | {' | '.join(increases)} |"
        )
    return lines


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1:]))
