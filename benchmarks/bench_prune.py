"""Pruning side by side, in one run: `llmq prune` vs llm-compressor's one-shot SparseGPTModifier
and WandaPruningModifier, at 50% (unstructured) and 2:4.

On the default model (SmolLM2-135M-Instruct, float32). Both tools prune the decoder layers'
linears only (lm_head and the tied embedding stay dense; the peer runner checks its output) and
write a dense checkpoint. Both calibrate on exactly the same token windows, sampled from pydoc by
llmq's sampler (the issue's 128 x 512) and handed to the peer as a file; each uses its own
default dampening and block size. Each tool runs in its own process (llm-compressor in its own
virtual environment); wall time and peak RSS are those of that process, from start to a saved
checkpoint (the peer's includes its ~5 s of imports and its zero count of the saved file). Every
checkpoint is scored by the same code on the same held-out windows of two texts: pydoc
(in-domain) and Hamlet (a domain not in the calibration data).

    python benchmarks/bench_prune.py [--samples 128 --seq-len 512 --windows 12] [--only TEXT]

Also llmq's magnitude pruning (no data, no peer row), llmq's SparseGPT and Wanda at 50% on its
default mixed calibration text (Shakespeare + pydoc, as many windows): the setting that targets
the out-of-domain Hamlet, held against the same peer rows; and both at 70% with a uniform and an
OWL and scan sparsity profiles (llmq alone: the peer has no profile).

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
    llmq_prune_cmd,
    peer_comparison,
    peer_prune_cmd,
    ppl_cells,
    preamble,
    run_jobs,
    save_report,
)

METHODS = {"wanda": "Wanda", "sparsegpt": "SparseGPT"}
SHAPES = {"50%": ["--sparsity", "0.5"], "2:4": ["--pattern", "2:4"]}


def jobs(samples: int, seq_len: int) -> list[Job]:
    main = f"{samples}x{seq_len}"
    rows = []
    for shape, target in SHAPES.items():
        rows.append(Job(LLMQ, f"magnitude {shape}", ["--method", "magnitude", *target, "--skip-layer-check"]))  # fmt: skip
        for method, name in METHODS.items():
            label = f"{name} {shape} pydoc {main}"
            rows.append(Job(PEER, label, ["--method", method, *target], "main"))
            rows.append(Job(LLMQ, label, ["--method", method, *target], "main", label))
    mixed = ["--num-samples", str(samples), "--seq-len", str(seq_len)]  # default text, seed 0
    for method, name in METHODS.items():
        same = f"{name} 50% pydoc {main}"
        rows.append(Job(LLMQ, f"{name} 50% default calib shakespeare+pydoc {main}",
                        ["--method", method, *SHAPES["50%"], *mixed], None, same, same))  # fmt: skip
    for method, name in METHODS.items():  # OWL's published effect, at 70%: llmq alone
        for profile in ("uniform", "owl", "scan"):
            rows.append(Job(LLMQ, f"{name} 70% {profile} default calib {main}",
                            ["--method", method, "--sparsity", "0.7", "--sparsity-profile", profile,
                             *mixed]))  # fmt: skip
    return rows


def main() -> None:
    args = job_arguments(__doc__, "prune")

    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    ensure_peer()
    calib = {
        "main": calibration_set(
            model, args.out / "calib-main.safetensors", args.samples, args.seq_len
        )
    }
    rows = run_jobs(
        jobs(args.samples, args.seq_len), model, args.out, calib, windows=args.windows,
        only=args.only, commands=(llmq_prune_cmd, peer_prune_cmd),
    )  # fmt: skip
    calibration = (
        f"pydoc, seed 0, {args.samples} x {args.seq_len} tokens (both tools); the 'default "
        "calib' rows: llmq's shakespeare+pydoc, as many windows"
    )
    save_report(args.out, rows, args.windows, markdown, calibration=calibration)


def shape(row: dict) -> str:
    return "2:4" if "--pattern" in row["options"] else "50%"


def markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [
        preamble(report),
        "",
        "| tool | method, sparsity, calibration | ppl held-out pydoc | ppl Hamlet | wall s | peak RSS GB | gap to fp32 closed vs llmq magnitude, same shape (pydoc / Hamlet) |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    magnitude = {shape(r): r for r in rows if r["tool"] == LLMQ and r["label"].startswith("magnitude")}  # fmt: skip
    for r in rows:
        base = magnitude.get(shape(r))
        closed = "-" if base is None else " / ".join(
            f"{1 - r['ppl'][t]['increase'] / base['ppl'][t]['increase']:+.0%}" for t in ("pydoc", "shakespeare")
        )  # fmt: skip
        lines.append(
            f"| {r['tool']} | {r['label']} | {ppl_cells(r)} | {r['wall_s']:.1f} | {r['peak_rss_gb']:.2f} | {closed} |"
        )
    lines += ["", *peer_comparison(rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
