"""What asymmetric int4 buys: AWQ and GPTQ with w4a16 (symmetric, loads everywhere) against
w4a16-asym (packed zero points, which plain transformers cannot load today), in one run.

On the default model (SmolLM2-135M-Instruct, float32), group size 64, calibrated on pydoc
(--samples x --seq-len, two seeds for AWQ so the seed-to-seed spread shows what "within noise"
means); RTN rows for reference. Every checkpoint is scored by the same code on the same held-out
windows of pydoc (in domain) and Hamlet (out of domain).

    python benchmarks/bench_asymmetry.py [--samples 128 --seq-len 512 --windows 12]

Perplexity protocol: token perplexity, first --windows non-overlapping 512-token windows of the
held-out splits, no BOS (the tokenizer adds none), float32 compute. Only llmq runs here: no peer
writes both variants with the same algorithm.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LLMQ, Job, ppl_table, run_jobs, save_report


def jobs(samples: int, seq_len: int, seeds: list[int]) -> list[Job]:
    g64 = ["--group-size", "64"]
    rows = [
        Job(LLMQ, "RTN w4a16", ["--scheme", "w4a16", *g64, "--skip-layer-check"]),
        Job(LLMQ, "RTN w4a16-asym", ["--scheme", "w4a16-asym", *g64, "--skip-layer-check"]),
    ]
    for method, seed_list in (("awq", seeds), ("gptq", seeds[:1])):
        for seed in seed_list:
            calib = ["--calib-text", "pydoc", "--num-samples", str(samples), "--seq-len",
                     str(seq_len), "--seed", str(seed)]  # fmt: skip
            for scheme in ("w4a16", "w4a16-asym"):
                label = f"{method.upper()} {scheme} seed {seed}"
                rows.append(Job(LLMQ, label, ["--scheme", scheme, "--method", method, *g64, *calib]))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=12, help="512-token windows per text")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seeds", default="0,1", help="calibration seeds for AWQ (GPTQ: first)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/asymmetry"))
    parser.add_argument("--only", default=None, help="labels containing one of these ('|')")
    args = parser.parse_args()

    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = run_jobs(
        jobs(args.samples, args.seq_len, seeds), model, args.out, {}, windows=args.windows,
        only=args.only,
    )  # fmt: skip
    calibration = f"pydoc, {args.samples} x {args.seq_len} tokens, seeds {args.seeds}"
    save_report(args.out, rows, args.windows, markdown, calibration=calibration)


def markdown(report: dict) -> str:
    return ppl_table(report, "method, scheme g64")


if __name__ == "__main__":
    main()
