"""FP4 side by side, in one run: llmq vs llm-compressor on NVFP4 and MXFP4, RTN and GPTQ.

On the default model (SmolLM2-135M-Instruct, float32), the FP4 presets of compressed-tensors 0.19
that both tools write: NVFP4A16 and NVFP4 (E2M1 codes, an E4M3 scale per 16 weights under a
float32 per-tensor global scale; NVFP4 also quantizes the linears' inputs in groups of 16 at run
time under a calibrated global scale) and MXFP4A16 and MXFP4 (E2M1 codes, a power-of-two E8M0
scale per 32; MXFP4's inputs are plainly dynamic). The formats fix the group sizes. Rows:

- llm-compressor: RTN (QuantizationModifier) and GPTQ (GPTQModifier, its defaults: static
  activation order, block 128, dampening 0.01) of the four.
- llmq: the four with --method rtn --clip none (plain min/max groups), --method rtn --clip mse,
  and --method gptq (llmq's defaults; for 4-bit codes that includes the output-error clip search
  on the calibration data).
- llmq's int4 at the same group sizes: GPTQ W4A16 g16 (against NVFP4A16) and g32 (against
  MXFP4A16).

Calibration: one set, --samples x --seq-len (the issue's 128 x 512), sampled from pydoc by llmq's
sampler (seed 0) and handed to the peer as a file, so both tools calibrate on exactly the same
token windows. It feeds every GPTQ row and NVFP4's RTN rows (its input global scale is
calibrated, in both tools); the other RTN rows read no data (llmq with --skip-layer-check, the
peer's data-free pipeline). Each tool runs in its own process (llm-compressor in its own virtual
environment); wall time and peak RSS are those of that process, from start to a saved
checkpoint. Every checkpoint is scored by the same code on the same held-out windows of three
texts: pydoc (in-domain), news articles and Hamlet (domains not in the calibration data); NVFP4
and MXFP4 checkpoints are scored with their activations quantized as the scheme says.

    python benchmarks/bench_fp4.py [--samples 128 --seq-len 512] [--only 'NVFP4A16|g16']

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
    TEXT_NAMES,
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

# compressed-tensors preset -> llmq --scheme, for the schemes both tools offer
SCHEMES = {"NVFP4A16": "nvfp4a16", "NVFP4": "nvfp4", "MXFP4A16": "mxfp4a16", "MXFP4": "mxfp4"}
CALIBRATED = ("NVFP4",)  # its input global scale is calibrated: even RTN reads the windows
PEER_GPTQ = tuple(SCHEMES)  # GPTQModifier takes every FP4 preset
TEXTS = ("pydoc", "news", "shakespeare")  # held-out: in domain, then two other domains


def jobs(main: str) -> list[Job]:
    rows = []
    for scheme, name in SCHEMES.items():
        calibrated = scheme in CALIBRATED
        rtn = f"RTN {scheme} {main}" if calibrated else f"RTN {scheme}"
        rtn_calib = "main" if calibrated else None
        data_free = [] if calibrated else ["--skip-layer-check"]
        rows += [
            Job(PEER, rtn, ["--scheme", scheme, "--method", "rtn"], rtn_calib),
            Job(LLMQ, rtn, ["--scheme", name, "--method", "rtn", "--clip", "none", *data_free],
                rtn_calib, rtn),
            Job(LLMQ, rtn.replace("RTN", "RTN+mse", 1),
                ["--scheme", name, "--method", "rtn", "--clip", "mse", *data_free], rtn_calib,
                rtn, rtn),
        ]  # fmt: skip
        gptq = f"GPTQ {scheme} {main}"
        if scheme in PEER_GPTQ:
            rows.append(Job(PEER, gptq, ["--scheme", scheme, "--method", "gptq"], "main"))
        # without a peer GPTQ row of this scheme (W4A4), held against the peer's RTN of it
        peer_row = gptq if scheme in PEER_GPTQ else rtn
        rows.append(Job(LLMQ, gptq, ["--scheme", name, "--method", "gptq"], "main", peer_row, rtn))
    for group, fp4 in (("16", "NVFP4A16"), ("32", "MXFP4A16")):
        rows.append(
            Job(LLMQ, f"GPTQ W4A16 g{group} {main}",
                ["--scheme", "w4a16", "--group-size", group, "--method", "gptq"], "main",
                f"GPTQ {fp4} {main}", f"GPTQ {fp4} {main}")
        )  # fmt: skip
    return rows


def main() -> None:
    args = job_arguments(__doc__, "fp4")

    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    ensure_peer()
    main_set = f"{args.samples}x{args.seq_len}"
    calib = {
        "main": calibration_set(
            model, args.out / "calib-main.safetensors", args.samples, args.seq_len
        ),
    }
    rows = run_jobs(
        jobs(main_set), model, args.out, calib, windows=args.windows, only=args.only, texts=TEXTS
    )
    calibration = f"pydoc, seed 0: {main_set} (samples x tokens)"
    save_report(args.out, rows, args.windows, markdown, TEXTS, calibration=calibration)


def scheme_of(row: dict) -> str:
    """The compressed-tensors preset name of a row's --scheme (either tool's spelling)."""
    options = row["options"]
    return options[options.index("--scheme") + 1].upper()


def markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [
        preamble(report, texts=TEXTS),
        "",
        "| tool | method, scheme, calibration | "
        + " | ".join(f"ppl {TEXT_NAMES[t]}" for t in TEXTS)
        + " | wall s | peak RSS GB | gap to fp32 closed vs llmq RTN of the scheme ("
        + " / ".join(TEXT_NAMES[t] for t in TEXTS) + ") |",
        "|---|---|" + "---|" * len(TEXTS) + "---|---|---|",
    ]  # fmt: skip
    # llmq's plain RTN row of each scheme: --clip none
    rtn = {scheme_of(r): r for r in rows if r["tool"] == LLMQ and r["label"].startswith("RTN ")}
    for r in rows:
        ref = rtn.get(scheme_of(r))
        closed = "-" if ref is None else " / ".join(
            f"{1 - r['ppl'][t]['increase'] / ref['ppl'][t]['increase']:+.0%}" for t in TEXTS
        )  # fmt: skip
        lines.append(
            f"| {r['tool']} | {r['label']} | {ppl_cells(r, TEXTS)} | {r['wall_s']:.1f} | {r['peak_rss_gb']:.2f} | {closed} |"
        )
    lines += ["", *peer_comparison(rows, TEXTS)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
