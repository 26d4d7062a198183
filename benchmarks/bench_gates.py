"""Do `llmq eval --tasks` gates flake? False-fail and true-fail rates on the default model.

    python benchmarks/bench_gates.py [--trials 20 --subset 150]

Per-item scores of both built-in tasks (300 items each, 0-shot, lm-eval through llmq's
harness, float32 on the CPU) are computed once for: the default model at batch size 8 (the
baseline), the same model at batch sizes 1 and 3 (the same checkpoint: any failure is a false
fail), and an RTN W4A16 g64 checkpoint of it (`llmq quantize --scheme w4a16 --group-size 64`:
+40% perplexity, a real loss). Each trial then draws `--subset` items at random (seed = trial)
and applies the gates to that subset, exactly as `llmq eval` does on the items it ran:
`--max-drop 0.01` and `--min-recovery 0.95`, confidence 0.95. An item's score does not depend
on which other items are scored, so drawing subsets from the full per-item scores is the same
as running lm-eval on each subset (save the batching, which the batch-size rows cover).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_json

TASKS = ["hamlet_cloze", "hamlet_next_line"]
GATES = [("max_drop", 0.01), ("min_recovery", 0.95)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--subset", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/gates"))
    args = parser.parse_args()

    import llmq
    from llmq.eval.gates import judge, paired_difference
    from llmq.eval.harness import score_tasks
    from llmq.io.checkpoint import open_checkpoint
    from llmq.models import builtin_model_path

    model = builtin_model_path("smollm2-135m")
    w4 = args.out / "rtn-w4a16-g64"
    if not (w4 / "config.json").is_file():
        llmq.quantize(model, w4, scheme="w4a16", group_size=64, overwrite=True)
    runs = {"baseline (batch 8)": (model, 8), "same model, batch 1": (model, 1),
            "same model, batch 3": (model, 3), "RTN W4A16 g64": (w4, 8)}  # fmt: skip
    scores, seconds = {}, {}
    for label, (path, batch) in runs.items():
        started = time.perf_counter()
        scores[label] = score_tasks(open_checkpoint(path), TASKS, batch_size=batch)
        seconds[label] = time.perf_counter() - started
    base = scores["baseline (batch 8)"]
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "trials": args.trials,
                    "subset": args.subset, "seconds": seconds, "rows": []}  # fmt: skip
    for label in list(runs)[1:]:
        for task in TASKS:
            ids = sorted(base[task].items)
            full = paired_difference([scores[label][task].items[i] for i in ids], [base[task].items[i] for i in ids])  # fmt: skip
            fails = {f"{kind} {t}": 0 for kind, t in GATES}
            for trial in range(args.trials):
                subset = random.Random(trial).sample(ids, args.subset)
                pair = paired_difference([scores[label][task].items[i] for i in subset], [base[task].items[i] for i in subset])  # fmt: skip
                for kind, threshold in GATES:
                    fails[f"{kind} {threshold}"] += not judge(pair, kind, threshold).passed  # type: ignore[arg-type]
            report["rows"].append({"model": label, "task": task, "score": full.score, "baseline": full.baseline,
                                   "difference": full.difference, "ci": [full.ci_low, full.ci_high],
                                   "fails": fails})  # fmt: skip
    write_json(args.out / "results.json", report)
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        f"Machine: {report['machine']}, {report['date']}. {report['trials']} subsets of {report['subset']} items (of 300) per row.",
        "",
        "| candidate | task | acc (all 300) | baseline | difference [95% CI] | fails of --max-drop 0.01 | fails of --min-recovery 0.95 |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in report["rows"]:
        fails = list(row["fails"].values())
        lines.append(
            f"| {row['model']} | {row['task']} | {row['score']:.3f} | {row['baseline']:.3f} | "
            f"{row['difference']:+.3f} [{row['ci'][0]:+.3f}, {row['ci'][1]:+.3f}] | "
            f"{fails[0]} / {report['trials']} | {fails[1]} / {report['trials']} |"
        )
    seconds = ", ".join(f"{k} {v:.0f} s" for k, v in report["seconds"].items())
    lines += ["", f"Time to score both tasks (600 items): {seconds}."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
