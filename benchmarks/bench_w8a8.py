"""W8A8 and FP8 side by side, in one run: llmq vs llm-compressor's SmoothQuant + GPTQ W8A8 and
FP8_DYNAMIC, plus llmq's variants (SmoothQuant alpha, static scales, MSE clipping, FP8 blocks,
a quantized KV cache).

On the default model (SmolLM2-135M-Instruct, float32). Calibrated jobs of both tools read exactly
the same token windows (pydoc, sampled by llmq's sampler and handed to the peer as a file). Each
tool runs in its own process (llm-compressor in its own virtual environment); wall time and peak
RSS are those of that process, from start to a saved checkpoint. Every checkpoint is scored by
the same code on the same held-out windows of pydoc and Hamlet, with activations (and the KV
cache) quantized exactly as its format specifies.

    python benchmarks/bench_w8a8.py [--samples 128] [--seq-len 512] [--windows 12] [--only TEXT]

Perplexity protocol: token perplexity, first --windows non-overlapping 512-token windows of the
held-out splits, no BOS (the tokenizer adds none), float32 compute.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    LLMQ,
    PEER,
    Job,
    calibration_set,
    ensure_peer,
    job_arguments,
    peer_comparison,
    ppl_cells,
    preamble,
    run_jobs,
    save_report,
)

PEER_SQ, PEER_FP8 = "SmoothQuant 0.8 + GPTQ W8A8", "FP8_DYNAMIC (RTN)"


def jobs() -> list[Job]:
    w8a8, fp8 = ["--scheme", "w8a8"], ["--scheme", "fp8"]
    plain = [*fp8, "--clip", "none"]  # fp8 as measured before its preset default became clip mse
    return [
        Job(PEER, PEER_SQ, ["--scheme", "W8A8", "--method", "smoothquant-gptq",
                            "--smoothing-strength", "0.8"], "main"),
        Job(PEER, PEER_FP8, ["--scheme", "FP8_DYNAMIC", "--method", "rtn"], None),
        Job(LLMQ, "W8A8 RTN", w8a8, None, PEER_SQ),
        Job(LLMQ, "W8A8 SmoothQuant 0.8, RTN", [*w8a8, "--smooth", "0.8"], "main", PEER_SQ, "W8A8 RTN"),
        Job(LLMQ, "W8A8 SmoothQuant auto, RTN", [*w8a8, "--smooth", "auto"], "main", PEER_SQ, "W8A8 RTN"),
        Job(LLMQ, "W8A8 SmoothQuant 0.8, GPTQ", [*w8a8, "--smooth", "0.8", "--method", "gptq"], "main",
            PEER_SQ, "W8A8 RTN"),
        Job(LLMQ, "W8A8 SmoothQuant auto, GPTQ", [*w8a8, "--smooth", "auto", "--method", "gptq"],
            "main", PEER_SQ, "W8A8 RTN"),
        Job(LLMQ, "FP8 RTN", plain, None, PEER_FP8),
        Job(LLMQ, "FP8 RTN, clip mse (the fp8 default)", fp8, None, PEER_FP8, "FP8 RTN"),
        Job(LLMQ, "W8A8 SmoothQuant 0.5, RTN", [*w8a8, "--smooth", "0.5"], "main", PEER_SQ, "W8A8 RTN"),
        Job(LLMQ, "FP8 SmoothQuant auto, RTN", [*plain, "--smooth", "auto"], "main", PEER_FP8,
            "FP8 RTN"),
        Job(LLMQ, "FP8 static absmax", [*plain, "--activations", "static"], "main", PEER_FP8,
            "FP8 RTN"),
        Job(LLMQ, "FP8 static mse", [*plain, "--activations", "static", "--observer", "mse"],
            "main", PEER_FP8, "FP8 RTN"),
        Job(LLMQ, "FP8 block 128x128", ["--scheme", "fp8-block"], None, PEER_FP8, "FP8 RTN"),
        Job(LLMQ, "FP8 RTN, KV cache fp8", [*plain, "--kv-cache", "fp8"], "main", PEER_FP8,
            "FP8 RTN"),
    ]  # fmt: skip


def main() -> None:
    args = job_arguments(__doc__, "w8a8")

    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    ensure_peer()
    calib = {
        "main": calibration_set(model, args.out / "calib.safetensors", args.samples, args.seq_len)
    }
    rows = run_jobs(jobs(), model, args.out, calib, windows=args.windows, only=args.only)
    calibration = f"pydoc, seed 0: {args.samples} x {args.seq_len} (samples x tokens)"
    save_report(args.out, rows, args.windows, markdown, calibration=calibration)


def markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [
        preamble(report, "Calibration (rows marked calibrated)"),
        "",
        "| tool | job | evaluated as | ppl held-out pydoc | ppl Hamlet | wall s | peak RSS GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tool']} | {r['label']} | {r['ppl']['pydoc']['simulated']} | {ppl_cells(r)} | "
            f"{r['wall_s']:.1f} | {r['peak_rss_gb']:.2f} |"
        )
    lines += ["", *peer_comparison(rows)]
    lines += ["", "| llmq variant | of | increase pydoc (ratio to its base) | increase Hamlet (ratio) |",
              "|---|---|---|---|"]  # fmt: skip
    ours = {r["label"]: r for r in rows if r["tool"] == LLMQ}
    for r in rows:
        base_row = ours.get(r.get("baseline") or "")
        if base_row is None:
            continue
        cells = [
            f"{r['ppl'][t]['increase']:+.2%} ({r['ppl'][t]['increase'] / base_row['ppl'][t]['increase']:.2f}x)"
            for t in ("pydoc", "shakespeare")
        ]
        lines.append(f"| {r['label']} | {base_row['label']} | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
