"""Mixed precision to a budget against every uniform scheme, in one run: held-out perplexity
against stored bits a weight, GPTQ for all.

The default model (SmolLM2-135M-Instruct) saved in bfloat16, as checkpoints ship (its float32
file would store scales in float32 and make every int4 group cost twice as many bits). Rows:

- uniform: GPTQ W4A16 at group 128 (576-wide linears take group 64: 128 does not divide them),
  64 and 32, and W8A16 per channel;
- mixed: `--target-bits B --method gptq` at budgets 4.25 ... 6 with the default candidates
  (int4-g128, int4-g64, int4-g32, int8, dense) and the default sensitivity (output error on the
  calibration data); and at the scored budgets the others (gradient: the output error weighted
  by the loss's squared output gradients, 8 windows; fisher: the loss's diagonal Fisher on 8
  windows; weight: data-free; residual: output error over the residual stream's mean square),
  to see which predicts perplexity better. "at g32" is the budget of uniform int4-g32's written
  bits (rounded up to 4 decimals);
- mixed+fp: gradient at 4.25, at g32 and 5 bits with the float formats' weights added to the
  candidates (fp8, nvfp4a16, mxfp4a16: MXFP4's E8M0 scale per 32 costs 4.25 bits a weight);
- gated: `--target-bits 4.25 --max-ppl-increase X` (GATES; held-out news, 40 windows), the
  budget raised by 0.25 bits until news passes; its attempts from llmq.json, its final
  checkpoint scored on pydoc / Hamlet like every row.

Bits are counted from the written files (every tensor of every decoder linear: packed codes,
scales, shape, dense weights), averaged over the decoder linears' weights. Calibration: pydoc,
seed 0, --samples x --seq-len, the same windows for every row. Each row runs in its own process;
rows already in results-partial.json are kept (rerun to continue after an interruption).

    python benchmarks/bench_mixed.py [--samples 128 --seq-len 512] [--only 'mixed output']

Perplexity protocol: token perplexity, first --windows non-overlapping 512-token windows of the
held-out splits, no BOS (the tokenizer adds none), float32 compute.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LLMQ, CalibSet, Job, job_arguments, ppl_cells, preamble, run_jobs, save_report

BUDGETS = (4.25, 4.5, "g32", 4.75, 5.0, 5.5, 6.0)  # "g32": uniform int4-g32's written bits
SENSITIVITIES = ("output", "gradient", "fisher", "weight", "residual")
SCORED_BUDGETS = (4.25, "g32", 5.0, 6.0)  # where the four sensitivities are compared
# the default candidates and the float formats' weights ("mixed+fp" rows)
FLOAT_CANDIDATES = (
    "int4-g128",
    "int4-g64",
    "int4-g32",
    "int8",
    "dense",
    "fp8",
    "nvfp4a16",
    "mxfp4a16",
)
# --max-ppl-increase gates on held-out news (40 windows, llmq's default), from 4.25 bits up
GATES = (0.10,)
DEFAULT = "output"  # the curve at every budget (works at any size; auto takes gradient here)
UNIFORM = {
    "int4-g128": ["--scheme", "w4a16"],
    "int4-g64": ["--scheme", "w4a16", "--group-size", "64"],
    "int4-g32": ["--scheme", "w4a16", "--group-size", "32"],
    "int8": ["--scheme", "w8a16"],
}


def jobs(g32_bits: float | None) -> list[Job]:
    """Uniform rows first (the g32 budget is their measured bits), then the default's curve at
    the scored budgets, the gradient score there, the rest of the curve, the other scores."""
    rows = [Job(LLMQ, f"uniform {name}", [*options, "--method", "gptq"], "main") for name, options in UNIFORM.items()]  # fmt: skip
    if g32_bits is None:
        return rows
    order = [(DEFAULT, b) for b in SCORED_BUDGETS]
    # the others where the default's curve is scored: gradient at each, fisher and weight but at
    # g32, residual where its first row lost
    order += [("gradient", b) for b in SCORED_BUDGETS]
    order += [(DEFAULT, b) for b in BUDGETS if b not in SCORED_BUDGETS]
    order += [("gradient", b) for b in BUDGETS if b not in SCORED_BUDGETS]
    order += [(s, b) for b in SCORED_BUDGETS for s in ("fisher", "weight") if b != "g32"]
    order += [("residual", 4.25)]
    order += [("gradient +fp", b) for b in (4.25, "g32", 5.0)]  # "mixed+fp gradient ..." rows
    for sensitivity, budget in order:
        bits = g32_bits if budget == "g32" else budget
        measure, _, extra = sensitivity.partition(" ")
        options = ["--method", "gptq", "--target-bits", f"{bits:.4f}", "--sensitivity", measure]
        options += ["--candidates", ",".join(FLOAT_CANDIDATES)] if extra else []
        kind = "mixed+fp" if extra else "mixed"
        rows.append(Job(LLMQ, f"{kind} {measure} {label(budget)}", options, "main"))
    for increase in GATES:
        options = ["--method", "gptq", "--target-bits", "4.25", "--max-ppl-increase", f"{increase:g}"]  # fmt: skip
        rows.append(Job(LLMQ, f"gated {increase:.0%} from 4.25", options, "main"))
    return rows


def gate_record(folder: Path) -> dict | None:
    """The attempts of a gated row, from its llmq.json."""
    record = json.loads((folder / "llmq.json").read_text())
    return (record.get("mixed_precision") or {}).get("gate")


def label(budget: float | str) -> str:
    return "at g32" if budget == "g32" else f"{budget:g}"


def bf16_copy(folder: Path) -> Path:
    """The default model saved in bfloat16 (once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmq.models import builtin_model_path

    if (folder / "config.json").is_file():
        return folder
    source = builtin_model_path("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def stored_bits(folder: Path, model: Path) -> float:
    from llmq.io.checkpoint import open_checkpoint
    from llmq.mixed.choose import written_bits

    return written_bits(folder, open_checkpoint(model))


def main() -> None:
    args = job_arguments(__doc__, "mixed")
    model = bf16_copy(args.out / "smollm2-135m-bf16")
    options = ["--calib-text", "pydoc", "--num-samples", str(args.samples), "--seq-len", str(args.seq_len), "--seed", "0"]  # fmt: skip
    calib = {"main": CalibSet(Path("-"), options)}
    partial = args.out / "results-partial.json"
    rows = json.loads(partial.read_text()) if partial.is_file() else []

    def run_missing(todo: list[Job]) -> None:
        for job in todo:
            done = {row["label"] for row in rows}
            if job.label in done or (args.only and not any(p in job.label for p in args.only.split("|"))):  # fmt: skip
                continue
            (row,) = run_jobs([job], model, args.out, calib, windows=args.windows, only=None)
            row["bits"] = stored_bits(args.out / job.folder, model)
            row["gate"] = gate_record(args.out / job.folder)
            rows.append(row)
            partial.write_text(json.dumps(rows, indent=1))

    run_missing(jobs(None))
    g32 = next(r["bits"] for r in rows if r["label"] == "uniform int4-g32")
    run_missing(jobs(math.ceil(g32 * 1e4) / 1e4)[len(UNIFORM) :])  # rounded up: g32 fits
    calibration = f"pydoc, seed 0: {args.samples}x{args.seq_len} (samples x tokens)"
    save_report(args.out, rows, args.windows, markdown, calibration=calibration)
    plot(rows, args.out / "mixed-precision.png")


def best_uniform(rows: list[dict], budget: float, text: str) -> dict | None:
    """The uniform row of least perplexity on `text` among those that fit `budget`."""
    fitting = [r for r in rows if r["label"].startswith("uniform") and r["bits"] <= budget]
    return min(fitting, key=lambda r: r["ppl"][text]["ppl"], default=None)


def target_bits(row: dict) -> float:
    return float(row["options"][row["options"].index("--target-bits") + 1])


def markdown(report: dict) -> str:
    rows = report["rows"]
    by_label = {r["label"]: r for r in rows}
    texts = ("pydoc", "shakespeare")
    lines = [
        preamble(report),
        "",
        "| row | bits a weight (written) | ppl held-out pydoc | ppl Hamlet | wall s |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['label']} | {r['bits']:.4f} | {ppl_cells(r)} | {r['wall_s']:.1f} |" for r in rows]  # fmt: skip
    curves = ("gradient", "output")  # auto's choice on this model, and the one for any size
    lines += ["", "| budget (bits) | " + " | ".join(f"mixed {c} pydoc / Hamlet" for c in curves) + " | best uniform that fits: pydoc / Hamlet |", "|---|---|---|---|"]  # fmt: skip
    for budget in BUDGETS:
        found = [by_label.get(f"mixed {c} {label(budget)}") for c in curves]
        if not any(found):
            continue
        bits = target_bits(next(r for r in found if r is not None))
        best = [best_uniform(rows, bits, text) for text in texts]
        cells = [
            "none fits" if u is None else f"{u['ppl'][t]['ppl']:.3f} ({u['label'].removeprefix('uniform ')})"
            for u, t in zip(best, texts, strict=True)
        ]  # fmt: skip
        ours = ["-" if r is None else " / ".join(f"{r['ppl'][t]['ppl']:.3f}" for t in texts) for r in found]  # fmt: skip
        lines.append(f"| {bits:g} | {' | '.join(ours)} | {' / '.join(cells)} |")
    lines += ["", "| budget | " + " | ".join(f"{s} pydoc / Hamlet" for s in SENSITIVITIES) + " |", "|---|" + "---|" * len(SENSITIVITIES)]  # fmt: skip
    for budget in SCORED_BUDGETS:
        found = [by_label.get(f"mixed {s} {label(budget)}") for s in SENSITIVITIES]
        cells = ["-" if r is None else " / ".join(f"{r['ppl'][t]['ppl']:.3f}" for t in texts) for r in found]  # fmt: skip
        lines.append(f"| {label(budget)} | {' | '.join(cells)} |")
    lines += gate_lines(rows)
    return "\n".join(lines)


def gate_lines(rows: list[dict]) -> list[str]:
    """Each gated row's attempts, against an ungated run at its last budget (same damages)."""
    lines = ["", "| gate (news, +at most) | attempts: bits -> news increase | final pydoc / Hamlet | wall s | ungated run at the final budget: wall s |", "|---|---|---|---|---|"]  # fmt: skip
    by_label = {r["label"]: r for r in rows}
    for row in (r for r in rows if r.get("gate")):
        attempts = row["gate"]["attempts"]
        steps = ", ".join(f"{a['written_bits']:.3f} -> {a['ppl_increase']:+.2%}" for a in attempts)
        ungated = by_label.get(f"mixed gradient {label(attempts[-1]['target_bits'])}")
        plain = "-" if ungated is None else f"{ungated['wall_s']:.1f}"
        lines.append(f"| {row['gate']['max_ppl_increase']:.0%} | {steps} | {ppl_cells(row)} | {row['wall_s']:.1f} | {plain} |")  # fmt: skip
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """Held-out pydoc perplexity against written bits: uniform points, one curve per sensitivity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    uniform = [r for r in rows if r["label"].startswith("uniform")]
    axes.scatter([r["bits"] for r in uniform], [r["ppl"]["pydoc"]["ppl"] for r in uniform], color="black", zorder=3, label="uniform GPTQ")  # fmt: skip
    for r in uniform:
        axes.annotate(r["label"].removeprefix("uniform "), (r["bits"], r["ppl"]["pydoc"]["ppl"]), textcoords="offset points", xytext=(4, 4), fontsize=8)  # fmt: skip
    for sensitivity, style in zip(SENSITIVITIES, ("o-", "v-", "s--", "^:", "d-."), strict=True):
        mixed = sorted((r for r in rows if r["label"].startswith(f"mixed {sensitivity} ")), key=lambda r: r["bits"])  # fmt: skip
        if mixed:
            axes.plot([r["bits"] for r in mixed], [r["ppl"]["pydoc"]["ppl"] for r in mixed], style, label=f"mixed GPTQ ({sensitivity})")  # fmt: skip
    axes.axhline(rows[0]["ppl"]["pydoc"]["base"], color="grey", lw=0.8, label="bfloat16 model")
    axes.set_xlabel("stored bits a weight, decoder linears (counted from the files)")
    axes.set_ylabel("held-out pydoc perplexity")
    axes.set_title("SmolLM2-135M (bf16): mixed precision vs uniform schemes")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
