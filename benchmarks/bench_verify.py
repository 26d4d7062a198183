"""`llmq verify` on the default model: how far each loader lands from the recorded reference
per scheme, and how far one tampered group scale moves it, in one run.

    python benchmarks/bench_verify.py [--out benchmarks/out/verify]

For each scheme: quantize SmolLM2-135M-Instruct (float32, data-free RTN), then verify with
every installed loader (plain transformers, llmq's kernels or their torch reference on the CPU;
vLLM when installed). The distance is the largest |Δ log-probability| over the reference's top
8 tokens at every position of the three recorded prompts (float32). Then one group scale of one
linear of the W4A16 checkpoint (64 of 135M weights) is doubled and the checkpoint verified again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

SCHEMES = ("w4a16", "w4a16-asym", "w8a16", "w8a8", "fp8", "fp8-block")
TAMPERED = "model.layers.10.mlp.down_proj.weight_scale"


def verify_row(label: str, out: Path) -> dict:
    import llmq

    started = time.perf_counter()
    result = llmq.verify(out)
    loaders = {}
    for row in result.loaders:
        comparison = row.comparison
        loaders[row.loader] = {
            "status": row.status,
            "max_abs": None if comparison is None else comparison.distance.max_abs,
            "tolerance": None if comparison is None else comparison.tolerance,
            "reference": None if comparison is None else comparison.reference,
            "reason": row.detail if comparison is None else None,
        }
    return {"label": label, "passed": result.passed, "changed_files": result.changed_files,
            "loaders": loaders, "seconds": time.perf_counter() - started}  # fmt: skip


def tamper(source: Path, dest: Path) -> None:
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    shard = dest / json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"][TAMPERED]  # fmt: skip
    tensors = load_file(shard)
    tensors[TAMPERED][5, 3] *= 2
    save_file(tensors, shard, metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/verify"))
    args = parser.parse_args()

    import llmq

    rows = []
    for scheme in SCHEMES:
        out = args.out / scheme
        llmq.quantize("smollm2-135m", out, scheme=scheme, group_size=64 if "w4" in scheme else None,
                      skip_layer_check=True, overwrite=True)  # fmt: skip
        rows.append(verify_row(scheme, out))
        print(f"done: {scheme}", file=sys.stderr, flush=True)
    tamper(args.out / "w4a16", args.out / "w4a16-tampered")
    rows.append(verify_row(f"w4a16, {TAMPERED}[5, 3] doubled", args.out / "w4a16-tampered"))
    (args.out / "results.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))  # fmt: skip
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    loaders = sorted({name for row in rows for name in row["loaders"]})
    lines = [
        "| checkpoint (g64 for int4) | " + " | ".join(loaders) + " | files | verify |",
        "|---|" + "---|" * (len(loaders) + 2),
    ]
    for row in rows:
        cells = []
        for name in loaders:
            cell = row["loaders"].get(name)
            if cell is None:
                cells.append("-")
            elif cell["max_abs"] is None:
                cells.append(f"{cell['status']}: {cell['reason']}")
            else:
                cells.append(f"{cell['status']}: {cell['max_abs']:.3g} (tolerance {cell['tolerance']:.3g}, {cell['reference']})")  # fmt: skip
        files = (
            "unchanged"
            if not row["changed_files"]
            else "changed: " + ", ".join(row["changed_files"])
        )
        lines.append(f"| {row['label']} | " + " | ".join(cells) + f" | {files} | {'PASS' if row['passed'] else 'FAIL'} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
