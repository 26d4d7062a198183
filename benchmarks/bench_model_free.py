"""Model-free conversion on a multi-shard bf16 checkpoint of Llama-3-8B layer shapes (random
weights: time and memory only), side by side in one run with a plain read of the same files,
llm-compressor 0.14's `model_free_ptq` and llmq's own layer pipeline.

    python benchmarks/bench_model_free.py [--layers 6] [--repeat 3] [--mse] [--out benchmarks/out/model-free]

Rows, alternating, medians of --repeat runs, page cache dropped for the source before each cold
run (`posix_fadvise(DONTNEED)`, as bench_fallback.py): the plain read (every tensor read with
safetensors and summed); `llmq quantize --scheme fp8 --clip none` model-free (per-channel
absmax, llm-compressor's FP8_DYNAMIC rounding), the conversion's own seconds from its report and
the whole process's wall; the peer's FP8_DYNAMIC with as many threads. Once each: llmq's layer
pipeline on the same recipe (`--no-model-free --skip-layer-check`), and with --mse llmq's default
FP8 (its MSE clip search). Peak RSS is each whole process's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fallback import _evict, plain_read
from common import (
    HERE,
    PEER_PYTHON,
    ensure_peer,
    llmq_quantize_cmd,
    machine,
    run_measured,
    write_json,
)

WORKERS = 2  # this machine's cores; both tools get as many threads


def make_model(folder: Path, layers: int) -> Path:
    if not (folder / "config.json").is_file():
        from llmq.models import builtin_model_path

        subprocess.run(
            [
                sys.executable,
                str(HERE / "random_model.py"),
                str(folder),
                "--arch",
                "llama3-8b",
                "--layers",
                str(layers),
                "--max-shard-size",
                "1GB",
                "--tokenizer",
                str(builtin_model_path("smollm2-135m")),
            ],
            check=True,
        )
    return folder


def prepare(files: list[Path], cache: str) -> None:
    """Cold: the files' pages dropped from the page cache; warm: read once."""
    if cache == "cold":
        _evict(files)
    else:
        plain_read(files)


def llmq_run(model: Path, out: Path, options: list[str]) -> dict:
    measured = run_measured(llmq_quantize_cmd(model, out, ["--no-reference", *options]))
    report = json.loads(measured.stdout)
    converted = report.get("model_free") or {}
    return {
        "wall_s": measured.wall_s,
        "rss": measured.peak_rss_bytes,
        "seconds": converted.get("seconds", report["seconds"]),
    }


def peer_run(model: Path, out: Path) -> dict:
    cmd = [
        str(PEER_PYTHON),
        str(HERE / "peers" / "llmcompressor_model_free.py"),
        "--model",
        str(model),
        "--out",
        str(out),
        "--workers",
        str(WORKERS),
    ]
    measured = run_measured(cmd)
    report = json.loads(measured.stdout.strip().splitlines()[-1])
    return {"wall_s": measured.wall_s, "rss": measured.peak_rss_bytes, "seconds": report["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "out" / "model-free")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument(
        "--mse", action="store_true", help="also llmq's default fp8 (MSE clip search)"
    )
    args = parser.parse_args()
    if not args.no_peer:
        ensure_peer()
    model = make_model(args.out / f"llama3-8b-{args.layers}-layers", args.layers)
    files = sorted(model.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    runs: dict[str, list[dict]] = {}
    llmq_fp8 = ["--scheme", "fp8", "--clip", "none"]
    for _ in range(args.repeat):
        for cache in ("cold", "warm"):
            prepare(files, cache)
            runs.setdefault(f"read {cache}", []).append({"seconds": plain_read(files)})
            prepare(files, cache)
            runs.setdefault(f"llmq {cache}", []).append(
                llmq_run(model, args.out / "llmq", llmq_fp8)
            )
            if not args.no_peer:
                prepare(files, cache)
                runs.setdefault(f"peer {cache}", []).append(peer_run(model, args.out / "peer"))
    plain_read(files)
    runs["llmq layer pipeline warm"] = [
        llmq_run(model, args.out / "pipeline", [*llmq_fp8, "--no-model-free", "--skip-layer-check"])
    ]
    if args.mse:
        runs["llmq default fp8 (mse clip) warm"] = [
            llmq_run(model, args.out / "llmq", ["--scheme", "fp8"])
        ]
    rows = {
        label: {key: statistics.median(run[key] for run in done) for key in done[0]}
        for label, done in runs.items()
    }
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "source_bytes": size,
        "files": len(files),
        "layers": args.layers,
        "workers": WORKERS,
        "rows": rows,
        "runs": runs,
    }
    write_json(args.out / "results.json", report)
    print(markdown(report))


def markdown(report: dict) -> str:
    size = report["source_bytes"]
    rows = report["rows"]
    lines = [
        f"{report['files']} bf16 shards, {size / 1e9:.2f} GB ({report['layers']} layers of "
        f"Llama-3-8B shapes), {report['machine']}, {report['date']}",
        "",
        "| run | conversion s | GB/s of source | share of the plain read's speed | process wall s | peak RSS GB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, row in rows.items():
        cache = "cold" if "cold" in label else "warm"
        read = rows.get(f"read {cache}", {}).get("seconds")
        share = f"{read / row['seconds']:.0%}" if read else ""
        wall = f"{row['wall_s']:.1f}" if "wall_s" in row else ""
        rss = f"{row['rss'] / 1e9:.2f}" if "rss" in row else ""
        lines.append(
            f"| {label} | {row['seconds']:.2f} | {size / 1e9 / row['seconds']:.2f} | {share} | {wall} | {rss} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
