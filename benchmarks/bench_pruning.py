"""Pruned and quantized in one pass: magnitude, Wanda and SparseGPT at 50% and 2:4 on the
default model, in one run (llmq only; the peer comparison of issue 39 needs `llmq prune`'s
prune-only output, not built yet).

    python benchmarks/bench_pruning.py [--samples 32 --seq-len 512 --windows 12]

Every job quantizes SmolLM2-135M-Instruct (float32) with --method magnitude|wanda|sparsegpt and
--sparsity 0.5 or --pattern 2:4, calibrated on llmq's default mixed text (Shakespeare + pydoc;
magnitude reads none). W8A16 (per channel, +0.13% alone on pydoc) is nearly lossless, so those
rows show the cost of the pruning; the W4A16 g64 rows show pruning and 4-bit quantization in one
pass. Perplexity protocol: token perplexity, first --windows non-overlapping 512-token windows of
the held-out splits of pydoc and Hamlet, no BOS, float32.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LLMQ, Job, job_arguments, ppl_table, run_jobs, save_report


def jobs(samples: int, seq_len: int) -> list[Job]:
    calib = ["--num-samples", str(samples), "--seq-len", str(seq_len)]
    rows = []
    for scheme in (["--scheme", "w8a16"], ["--scheme", "w4a16", "--group-size", "64"]):
        label = scheme[1] + (" g64" if len(scheme) > 2 else "")
        rows.append(Job(LLMQ, f"{label} alone", [*scheme, "--skip-layer-check"]))
        for target in (["--sparsity", "0.5"], ["--pattern", "2:4"]):
            shape = "50%" if target[0] == "--sparsity" else "2:4"
            rows.append(Job(LLMQ, f"{label} magnitude {shape}", [*scheme, "--method", "magnitude", *target, "--skip-layer-check"]))  # fmt: skip
            for method in ("wanda", "sparsegpt"):
                rows.append(Job(LLMQ, f"{label} {method} {shape}", [*scheme, "--method", method, *target, *calib]))  # fmt: skip
    return rows


def main() -> None:
    args = job_arguments(__doc__, "pruning", samples=32)

    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    rows = run_jobs(
        jobs(args.samples, args.seq_len), model, args.out, {}, windows=args.windows, only=args.only
    )
    calibration = (
        f"shakespeare+pydoc (llmq's default), {args.samples} x {args.seq_len} tokens, seed 0"
    )
    save_report(args.out, rows, args.windows, markdown, calibration=calibration)


def markdown(report: dict) -> str:
    return ppl_table(report, "scheme, method, sparsity")


if __name__ == "__main__":
    main()
