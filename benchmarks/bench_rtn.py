"""RTN side by side, in one run: llmq vs llm-compressor's QuantizationModifier.

On the default model (SmolLM2-135M-Instruct, float32) each tool quantizes to the same schemes
in its own process (llm-compressor in its own virtual environment); wall time and peak RSS are
those of that process, from start to a saved checkpoint. Every checkpoint, both tools', is then
scored by the same code (llmq's perplexity, activations quantized per token where the scheme
says so) on the same held-out windows of two texts.

    python benchmarks/bench_rtn.py [--windows 16] [--out benchmarks/out/rtn]

Perplexity protocol: token perplexity, held-out pydoc topics and Hamlet, non-overlapping
512-token windows from the start (first --windows of each), no BOS (the tokenizer adds none),
float32 compute.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    ensure_peer,
    held_out_perplexity,
    llmq_quantize_cmd,
    peer_quantize_cmd,
    ppl_cells,
    preamble,
    run_measured,
    save_report,
)


@dataclass(frozen=True)
class Job:
    tool: str
    scheme: str  # rows of the same scheme are compared with each other
    options: list[str]
    variant: str = ""

    @property
    def label(self) -> str:
        return f"{self.scheme} ({self.variant})" if self.variant else self.scheme

    @property
    def folder(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "-", f"{self.tool} {self.label}").strip("-")


JOBS = [
    Job("llmq", "W4A16", ["--scheme", "w4a16"], "g128; g64 where 128 does not divide"),
    Job("llmq", "W4A16 g64", ["--scheme", "w4a16", "--group-size", "64"]),
    Job("llmq", "W4A16 g64", ["--scheme", "w4a16", "--group-size", "64", "--skip-layer-check"],
        "--skip-layer-check"),
    Job("llmq", "W4A16 g64", ["--scheme", "w4a16", "--group-size", "64", "--clip", "mse"],
        "--clip mse"),
    Job("llm-compressor", "W4A16 g64", ["--scheme", "W4A16", "--method", "rtn", "--group-size", "64"]),
    Job("llmq", "W8A16", ["--scheme", "w8a16"]),
    Job("llm-compressor", "W8A16", ["--scheme", "W8A16", "--method", "rtn", "--group-size", "0"]),
    Job("llmq", "W8A8", ["--scheme", "w8a8"]),
    Job("llmq", "W8A8", ["--scheme", "w8a8", "--skip-layer-check"], "--skip-layer-check"),
    Job("llm-compressor", "W8A8", ["--scheme", "W8A8", "--method", "rtn"]),
    Job("llmq", "FP8_DYNAMIC", ["--scheme", "fp8"]),
    Job("llm-compressor", "FP8_DYNAMIC", ["--scheme", "FP8_DYNAMIC", "--method", "rtn"]),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=16, help="512-token windows per text")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/rtn"))
    parser.add_argument("--only", default=None, help="run only jobs whose label contains this")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per job (median kept)")
    args = parser.parse_args()

    import llmq
    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    ensure_peer()
    args.out.mkdir(parents=True, exist_ok=True)
    # Warm llmq's token cache (and the page cache of the model file) outside the timed runs.
    llmq.quantize(model, args.out / "warmup", scheme="w8a16", overwrite=True)
    jobs = [j for j in JOBS if args.only is None or args.only in j.label]
    rows = []
    for job in jobs:
        out = (
            args.out
            / f"{job.tool}-{job.label.split(' (')[0].replace(' ', '-').replace('+', 'plus')}"
        )
        cmd = (llmq_quantize_cmd if job.tool == "llmq" else peer_quantize_cmd)(
            model, out, job.options
        )
        runs = sorted((run_measured(cmd) for _ in range(args.repeat)), key=lambda m: m.wall_s)
        measured = runs[len(runs) // 2]
        ppl = held_out_perplexity(out, model, args.windows)
        rows.append({"tool": job.tool, "label": job.label, "scheme": job.scheme, "wall_s": measured.wall_s,
                     "wall_s_runs": [m.wall_s for m in runs],
                     "peak_rss_gb": max(m.peak_rss_bytes for m in runs) / 1e9, "ppl": ppl})  # fmt: skip
        print(f"done: {job.tool} {job.label}: {measured.wall_s:.1f} s", file=sys.stderr, flush=True)
    save_report(args.out, rows, args.windows, markdown)


def markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [
        preamble(report),
        "",
        "| tool | scheme | ppl held-out pydoc | ppl Hamlet | wall s (process, median) | peak RSS GB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tool']} | {r['label']} | {ppl_cells(r)} | {r['wall_s']:.1f} | {r['peak_rss_gb']:.2f} |"
        )
    lines += ["", "| llmq row | llmq/peer wall | llmq/peer peak RSS | Δppl pydoc llmq vs peer | Δppl Hamlet llmq vs peer |",
              "|---|---|---|---|---|"]  # fmt: skip
    peers = {r["scheme"]: r for r in rows if r["tool"] == "llm-compressor"}
    for r in rows:
        peer = peers.get(r["scheme"])
        if r["tool"] != "llmq" or peer is None:
            continue
        lines.append(
            f"| {r['label']} | {r['wall_s'] / peer['wall_s']:.2f}x | {r['peak_rss_gb'] / peer['peak_rss_gb']:.2f}x | "
            f"{r['ppl']['pydoc']['increase']:+.2%} vs {peer['ppl']['pydoc']['increase']:+.2%} | "
            f"{r['ppl']['shakespeare']['increase']:+.2%} vs {peer['ppl']['shakespeare']['increase']:+.2%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
