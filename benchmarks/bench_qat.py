"""Quantization-aware distillation against post-training quantization on the default model
(issue 37's QAT target), in one run on this machine's CPU.

    python benchmarks/bench_qat.py [--steps 40 --lr 2e-5 --windows 20] [--scheme w4a16]
        [--group-size 64] [--inits float,gptq] [--reuse]

Model: SmolLM2-135M-Instruct, float32, W4A16 groups of 64 by default (its hidden size 576 is not
a multiple of 128; --group-size -1 for one scale per channel; --scheme w8a8 or fp8 for the
per-channel, per-token schemes). Post-training: `llmq quantize --method rtn` and `--method gptq`
with their defaults (128 x 512 calibration windows of the default mixed text). QAT: `llmq
distill --teacher M --student M --qat SCHEME` (forward KL to the float model, 512-token windows
of the calibration splits of shakespeare+pydoc, 4 a step, warm-up 3 steps then cosine, the last
step kept), once from the float weights (its step-0 model is exactly RTN without clipping) and
once from GPTQ's solution (`--qat-init gptq`); --inits picks which. Perplexity protocol: token
perplexity, first --windows 512-token windows of the held-out splits of news and Hamlet, no BOS,
float32, activations quantized as the scheme says, every checkpoint read back from its
compressed-tensors files. Recovery: (PTQ - QAT) / (PTQ - float) per text.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, run_measured, write_json

TEXTS = {"news": "news", "Hamlet": "shakespeare"}


def held_out(model: Path | str, windows: int) -> dict[str, float]:
    import llmq

    return {
        label: llmq.evaluate(model, text=text, max_windows=windows).model.perplexity
        for label, text in TEXTS.items()
    }


def _earlier(path: Path) -> dict:
    import json

    return json.loads(path.read_text()) if path.is_file() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--windows", type=int, default=20, help="512-token windows per text")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/qat"))
    parser.add_argument(
        "--reuse", action="store_true", help="keep outputs (and their times) of an earlier run"
    )
    parser.add_argument("--scheme", default="w4a16", help="a --qat scheme")
    parser.add_argument("--group-size", type=int, help="default 64 for w4a16, none otherwise")
    parser.add_argument(
        "--inits", default="float,gptq", help="the QAT runs' starts (--qat-init), comma-separated"
    )
    args = parser.parse_args()
    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    llmq = [sys.executable, "-m", "llmq"]
    report: dict[str, object] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                                 "steps": args.steps, "lr": args.lr, "windows": args.windows}  # fmt: skip
    group_size = args.group_size or (64 if args.scheme.startswith("w4") else None)
    grouping = [] if group_size is None else ["--group-size", str(group_size)]
    report["scheme"], report["group_size"] = args.scheme, group_size
    runs = {
        method: [*llmq, "quantize", str(model), "--out", str(out / method), "--scheme",
                 args.scheme, *grouping, "--method", method, "--overwrite", "--json"]
        for method in ("rtn", "gptq")
    }  # fmt: skip
    inits = args.inits.split(",")
    for init in inits:
        runs[f"qat-{init}"] = [
            *llmq, "distill", "--teacher", str(model), "--student", str(model),
            "--out", str(out / f"qat-{init}"), "--qat", args.scheme,
            *(["--qat-group-size", str(group_size)] if group_size else []), "--qat-init", init,
            "--max-steps", str(args.steps), "--lr", str(args.lr),
            "--warmup-steps", "3", "--grad-accum", "4", "--keep", "last", "--no-evaluate",
            "--overwrite", "--json",
        ]  # fmt: skip
    earlier = _earlier(out / "results.json") if args.reuse else {}
    seconds = {}
    for name, command in runs.items():
        if name in earlier.get("seconds", {}) and (out / name / "config.json").is_file():
            seconds[name] = earlier["seconds"][name]  # --reuse: kept from the earlier run
            continue
        measured = run_measured(command)
        seconds[name] = measured.wall_s
        print(f"{name}: {measured.wall_s:.1f} s", flush=True)
    report["seconds"] = seconds
    perplexity = {"float": held_out(model, args.windows)}
    for name in runs:
        perplexity[name] = held_out(out / name, args.windows)
        print(f"{name}: {perplexity[name]}", flush=True)
    report["perplexity"] = perplexity
    report["recovery"] = {
        f"{qat} vs {base}": {
            text: (perplexity[base][text] - perplexity[qat][text])
            / (perplexity[base][text] - perplexity["float"][text])
            for text in TEXTS
        }
        for qat in (f"qat-{init}" for init in inits)
        for base in ("rtn", "gptq")
    }
    print(report["recovery"])
    write_json(out / "results.json", report)


if __name__ == "__main__":
    main()
