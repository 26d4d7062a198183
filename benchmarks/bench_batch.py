"""`llmq batch` against the same jobs run one by one with the CLI (`llmq run`), in one run: 2
models x 3 recipes, wall time, and how often calibration windows were computed.

    python benchmarks/bench_batch.py [--windows 32] [--out benchmarks/out/batch]

Models: the embedded default (SmolLM2-135M-Instruct, float32) and the same weights saved in
bfloat16 (a second checkpoint with the same tokenizer, as a team's fine-tunes are). Recipes:
W8A16 RTN, GPTQ W4A16 g64, SmoothQuant + GPTQ W8A8, each calibrated on the default mixed text
(`--windows` x 512 tokens). Order: the CLI jobs one after another, then `llmq batch --jobs 1`,
then `llmq batch --jobs 2`; nothing else runs meanwhile. Writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import machine, run_measured

HERE = Path(__file__).resolve().parent

RECIPES = {
    "w8a16": "scheme: w8a16",
    "w4a16-gptq": "scheme: w4a16, group_size: 64, method: gptq",
    "w8a8-sq-gptq": "scheme: w8a8, method: gptq, smooth: 0.5",
}


def bf16_copy(source: Path, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (dest / "config.json").is_file():
        return
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(dest)
    AutoTokenizer.from_pretrained(source).save_pretrained(dest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--out", default=str(HERE / "out" / "batch"))
    args = parser.parse_args()
    from llmq.models import builtin_model_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = {"smollm2": builtin_model_path("smollm2-135m"), "smollm2-bf16": out / "smollm2-bf16"}
    bf16_copy(models["smollm2"], models["smollm2-bf16"])
    recipe_files = {}
    for name, options in RECIPES.items():
        recipe_files[name] = out / f"{name}.yaml"
        recipe_files[name].write_text(
            f"stages:\n  - quantize: {{{options}, num_samples: {args.windows}, seq_len: 512}}\n"
        )
    jobs = out / "jobs.yaml"
    jobs.write_text(
        f"models: [{', '.join(str(p) for p in models.values())}]\n"
        f"recipes: [{', '.join(str(p) for p in recipe_files.values())}]\n"
    )
    llmq = [sys.executable, "-m", "llmq.cli.main"]
    results: dict[str, object] = {
        "windows": args.windows, "date": time.strftime("%Y-%m-%d"), "machine": machine(),
    }  # fmt: skip
    one_by_one = []
    for model_name, model in models.items():
        for recipe_name, recipe in recipe_files.items():
            target = out / "cli" / model_name / recipe_name
            measured = run_measured([*llmq, "run", str(recipe), "--model", str(model), "--out", str(target), "--overwrite", "--json"])  # fmt: skip
            one_by_one.append({"job": f"{model_name}/{recipe_name}", "wall_s": measured.wall_s})
            print(f"cli {model_name}/{recipe_name}: {measured.wall_s:.1f} s", flush=True)
    results["cli"] = one_by_one
    results["cli_total_s"] = sum(job["wall_s"] for job in one_by_one)
    for parallel in (1, 2):
        target = out / f"batch-j{parallel}"
        measured = run_measured([*llmq, "batch", str(jobs), "--out", str(target), "--jobs", str(parallel), "--overwrite", "--json"])  # fmt: skip
        summary = json.loads(measured.stdout)
        results[f"batch_j{parallel}"] = {
            "wall_s": measured.wall_s,
            "calibration_windows_computed": summary["calibration_windows_computed"],
            "jobs": {job["id"]: {"status": job["status"], "seconds": job["seconds"],
                                 "shared_windows_reads": job["shared_windows_reads"]}
                     for job in summary["jobs"]},
        }  # fmt: skip
        print(f"batch --jobs {parallel}: {measured.wall_s:.1f} s, windows computed "
              f"{summary['calibration_windows_computed']}", flush=True)  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k.endswith("_s")}, indent=1))


if __name__ == "__main__":
    main()
