"""Pruned and quantized in one pass, or one after the other: SparseGPT 50% with W4A16 g64.

    python benchmarks/bench_joint.py [--samples 32 --seq-len 512 --windows 12]

Joint: `llmq quantize --method sparsegpt --sparsity 0.5 --scheme w4a16 --group-size 64` (the
solver prunes and quantizes each block together, the SparseGPT paper's joint mode). Separate:
`llmq prune --method sparsegpt --sparsity 0.5`, then `llmq quantize --method rtn` of the pruned
checkpoint with the same scheme (RTN keeps the zeros; GPTQ's update would fill them in). Both
calibrate on llmq's default mixed text (--samples x --seq-len tokens, seed 0) and end 50% sparse
with W4A16 g64 weights; each step runs in its own measured process. Perplexity protocol: token
perplexity, first --windows non-overlapping 512-token windows of the held-out splits of pydoc
and Hamlet, no BOS, float32, against the float32 model.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    held_out_perplexity,
    job_arguments,
    llmq_prune_cmd,
    llmq_quantize_cmd,
    ppl_table,
    run_measured,
    save_report,
)

SCHEME = ["--scheme", "w4a16", "--group-size", "64"]
SPARSEGPT = ["--method", "sparsegpt", "--sparsity", "0.5"]


def main() -> None:
    args = job_arguments(__doc__, "joint", samples=32)
    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    calib = ["--num-samples", str(args.samples), "--seq-len", str(args.seq_len)]
    joint, pruned, separate = (args.out / name for name in ("joint", "pruned", "separate"))
    steps = {
        "joint: quantize --method sparsegpt": [
            llmq_quantize_cmd(model, joint, [*SPARSEGPT, *SCHEME, *calib])
        ],
        "separate: prune --method sparsegpt, then quantize --method rtn": [
            llmq_prune_cmd(model, pruned, [*SPARSEGPT, *calib]),
            llmq_quantize_cmd(pruned, separate, [*SCHEME, "--skip-layer-check"]),
        ],
    }
    rows = []
    for (label, commands), folder in zip(steps.items(), (joint, separate), strict=True):
        wall = sum(run_measured(command).wall_s for command in commands)
        rows.append({"label": label, "wall_s": wall, "ppl": held_out_perplexity(folder, model, args.windows)})  # fmt: skip
        print(f"done: {label}: {wall:.1f} s", file=sys.stderr, flush=True)
    calibration = (
        f"shakespeare+pydoc (llmq's default), {args.samples} x {args.seq_len} tokens, seed 0"
    )
    save_report(args.out, rows, args.windows, lambda r: ppl_table(r, "SparseGPT 50% + W4A16 g64"), calibration=calibration)  # fmt: skip


if __name__ == "__main__":
    main()
