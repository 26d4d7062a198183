"""Time and peak memory a layer at real models' layer shapes on this machine: 2-layer random
checkpoints (bf16; shapes decide time and memory, values do not) of Llama-3-8B, Llama-3-70B and
Qwen3-235B-A22B, each converted to FP8 model-free, to FP8 by the layer pipeline (its one-window
output check) and with GPTQ W4A16 g128, each run its own process.

    python benchmarks/bench_scale.py [--shapes llama3-8b llama3-70b qwen3-235b] \\
        [--runs fp8-model-free fp8-pipeline gptq] [--samples 4 --seq-len 512] [--work DIR]

A full model's time extrapolates as wall(2 layers) + (L - 2) x (seconds of the second layer);
model-free, as start-up + the full bf16 checkpoint at the measured GB/s. Its peak memory is the
2-layer peak (flat in depth: one layer, or a few tensors in flight, at a time). Qwen3-235B's GPTQ gives
each expert its routed tokens (`--moe-calibration routed`): every token through all 128 experts
is 16x the MLP's work, beyond 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe_memory
from common import HERE, machine, run_measured, write_json

LAYERS = {"llama3-8b": 32, "llama3-70b": 80, "qwen3-235b": 94}  # the real models' depth
FULL_GB = {"llama3-8b": 16.1, "llama3-70b": 141.1, "qwen3-235b": 470.2}  # their bf16 checkpoints
RUNS = {
    "fp8-model-free": ["--scheme", "fp8", "--clip", "none"],
    "fp8-pipeline": ["--scheme", "fp8", "--clip", "none", "--no-model-free", "--num-samples", "1"],
    "gptq": ["--scheme", "w4a16", "--method", "gptq"],
}


def make_model(shape: str, folder: Path) -> Path:
    from llmq.models import builtin_model_path

    tokenizer = builtin_model_path("smollm2-135m")
    if (folder / "config.json").is_file():
        return folder
    if shape == "qwen3-235b":
        bench_moe_memory.write_model(folder, 2, tokenizer, "qwen3_moe")
    else:
        subprocess.run(
            [sys.executable, str(HERE / "random_model.py"), str(folder), "--arch", shape,
             "--layers", "2", "--max-shard-size", "2GB", "--tokenizer", str(tokenizer)],
            check=True,
        )  # fmt: skip
    return folder


def run(model: Path, out: Path, shape: str, name: str, args: argparse.Namespace) -> dict:
    options = list(RUNS[name])
    if name == "gptq":
        options += ["--num-samples", str(args.samples), "--seq-len", str(args.seq_len)]
        if shape == "qwen3-235b":
            options += ["--moe-calibration", "routed"]
    cmd = [sys.executable, "-m", "llmq.cli.main", "quantize", str(model), "--out", str(out),
           "--overwrite", "--json", "--no-reference", "--no-space-check", *options]  # fmt: skip
    measured = run_measured(cmd)
    result = json.loads(measured.stdout)
    layers = [round(layer["seconds"], 1) for layer in result["layers"]]
    source_gb = result["size_bytes"]["source"] / 1e9
    converted = (result.get("model_free") or {}).get("seconds")
    if layers:  # the rest of the layers at the second one's pace
        extrapolated = measured.wall_s + (LAYERS[shape] - 2) * layers[-1]
    else:  # model-free: the whole checkpoint at the measured speed, plus start-up
        extrapolated = measured.wall_s - converted + FULL_GB[shape] / (source_gb / converted)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "shape": shape, "run": name, "options": " ".join(options),
        "wall_s": round(measured.wall_s, 1), "peak_rss_gb": round(measured.peak_rss_bytes / 1e9, 2),
        "layer_seconds": layers,
        "model_free_seconds": converted,
        "full_model_s": round(extrapolated),
        "source_gb": round(source_gb, 2),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--work", type=Path, default=HERE / "out" / "scale")
    parser.add_argument(
        "--keep-models", action="store_true", help="else each is deleted after its runs"
    )
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        model = make_model(shape, args.work / shape)
        for name in args.runs:
            rows.append(run(model, args.work / f"{shape}-out", shape, name, args))
            print(json.dumps(rows[-1]), flush=True)
        if not args.keep_models:
            shutil.rmtree(model)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "rows": rows}
    write_json(args.work / "results.json", report)
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | run | 2-layer wall s | s a layer | peak RSS GB | full model, extrapolated |",
        "|---|---|---:|---|---:|---:|",
    ]
    for row in rows:
        per_layer = ", ".join(map(str, row["layer_seconds"])) or f"model-free {row['model_free_seconds']} s in all"  # fmt: skip
        full = f"{row['full_model_s']} s"
        lines.append(f"| {row['shape']} | {row['run']} | {row['wall_s']} | {per_layer} | {row['peak_rss_gb']} | {full} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
