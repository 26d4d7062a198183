"""Pruning while distilling against one-shot pruning then distilling, on the default model
(issue 37's GMP and iterative targets), in one run on this machine's CPU.

    python benchmarks/bench_gmp.py [--steps 24 --lr 1e-4 --windows 20] [--reuse]

Model: SmolLM2-135M-Instruct, float32; the teacher is always the dense model. Every arm trains
the same number of steps (--steps optimizer steps of 4 x 512-token windows of the calibration
splits of shakespeare+pydoc, forward KL, warm-up 2 steps then cosine, the last step kept):

- 50%: one-shot `llmq prune --method sparsegpt --sparsity 0.5` (128 x 512 default mixed
  calibration) then `llmq distill` of the pruned student, against `llmq distill --prune gmp
  --prune-method wanda --sparsity 0.5` from the dense model (the cubic schedule to 3/4 of the
  steps, masks every step). The one-shot arm also spends its pruning pass.
- 70%: one-shot SparseGPT 70% then distill, against `llmq distill --prune iterative
  --prune-method sparsegpt --sparsity 0.7 --rounds 3`, with `--round-schedule geometric` (33% of
  the remaining weights a round) and `cubic` (49.3%, 67.4%, 70%), steps/3 of distillation after
  each: the same distillation tokens, three pruning passes.

Perplexity protocol: token perplexity, first --windows 512-token windows of the held-out splits
of news and Hamlet, no BOS, float32, every checkpoint read back from its files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qat import TEXTS, held_out
from common import machine, run_measured, write_json


def runs(model: Path, out: Path, steps: int, lr: float) -> dict[str, list[str]]:
    llmq = [sys.executable, "-m", "llmq"]
    train = ["--max-steps", str(steps), "--lr", str(lr), "--warmup-steps", "2", "--grad-accum",
             "4", "--keep", "last", "--no-evaluate", "--overwrite", "--json"]  # fmt: skip

    def prune(name: str, sparsity: str) -> list[str]:
        return [*llmq, "prune", str(model), "--out", str(out / name), "--method", "sparsegpt",
                "--sparsity", sparsity, "--overwrite", "--json"]  # fmt: skip

    def distill(name: str, student: Path, *options: str) -> list[str]:
        return [*llmq, "distill", "--teacher", str(model), "--student", str(student),
                "--out", str(out / name), *options, *train]  # fmt: skip

    gmp = ["--prune", "gmp", "--prune-method", "wanda", "--sparsity", "0.5"]
    iterative = ["--prune", "iterative", "--prune-method", "sparsegpt", "--sparsity", "0.7",
                 "--rounds", "3"]  # fmt: skip
    geometric = [*iterative, "--round-schedule", "geometric"]
    cubic = [*iterative, "--round-schedule", "cubic"]
    return {
        "sparsegpt-50": prune("sparsegpt-50", "0.5"),
        "sparsegpt-50+distill": distill("sparsegpt-50+distill", out / "sparsegpt-50"),
        "gmp-wanda-50": distill("gmp-wanda-50", model, *gmp),
        "sparsegpt-70": prune("sparsegpt-70", "0.7"),
        "sparsegpt-70+distill": distill("sparsegpt-70+distill", out / "sparsegpt-70"),
        "iterative-sparsegpt-70": distill("iterative-sparsegpt-70", model, *geometric),
        "iterative-cubic-sparsegpt-70": distill("iterative-cubic-sparsegpt-70", model, *cubic),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--windows", type=int, default=20, help="512-token windows per text")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/gmp"))
    parser.add_argument("--reuse", action="store_true", help="keep outputs of an earlier run")
    args = parser.parse_args()
    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.json"
    earlier = json.loads(results.read_text()) if args.reuse and results.is_file() else {}
    report: dict[str, object] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                                 "steps": args.steps, "lr": args.lr, "windows": args.windows}  # fmt: skip
    seconds: dict[str, float] = {}
    for name, command in runs(model, args.out, args.steps, args.lr).items():
        if name in earlier.get("seconds", {}) and (args.out / name / "config.json").is_file():
            seconds[name] = earlier["seconds"][name]
            continue
        seconds[name] = run_measured(command).wall_s
        print(f"{name}: {seconds[name]:.1f} s", flush=True)
    report["seconds"] = seconds
    perplexity = {"dense": held_out(model, args.windows)}
    for name in seconds:
        perplexity[name] = held_out(args.out / name, args.windows)
        print(f"{name}: {perplexity[name]}", flush=True)
    report["perplexity"] = perplexity
    report["iterative_rounds"] = {
        name: json.loads((args.out / name / "llmq.json").read_text())["distillation"]["rounds"]
        for name in ("iterative-sparsegpt-70", "iterative-cubic-sparsegpt-70")
    }
    report["texts"] = TEXTS
    write_json(results, report)


if __name__ == "__main__":
    main()
