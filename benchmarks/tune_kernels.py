"""Tune llmq's Triton GEMMs on the GPU at hand: time candidate tile configs of each kernel per M
bucket over several layer shapes, keep the candidate with the best geometric mean over the
shapes, and write the table `llmq.kernels.tuning` reads.

    python benchmarks/tune_kernels.py [--shapes 4096x14336,...] [--out DIR]

Writes DIR/<gpu>.json (the table: copy it to llmq/kernels/tuned/ to ship it) and DIR/cells.json
(every candidate's time and error per shape and M, the built-in rule's config marked). Each
candidate is checked against a float32 product of the same (de)quantized operands before it is
timed (bench_kernels.measure); a wrong one is recorded and never chosen. Time per call: CUDA
graph over rotating weight copies (L2-cold), median of --trials trials.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_kernels import Variant, measure  # noqa: E402

from llmq.config import get_scheme  # noqa: E402
from llmq.kernels import w4a16, w8a8  # noqa: E402
from llmq.kernels.support import TileConfig  # noqa: E402
from llmq.kernels.tuning import (  # noqa: E402
    KERNELS,
    M_BUCKETS,
    TUNING_ENV,
    TunedConfig,
    table_json,
    table_name,
)
from llmq.runtime.bench import Shape, synthetic_linear  # noqa: E402
from llmq.runtime.modules import QuantizedLinear  # noqa: E402
from llmq.runtime.timing import copies_for  # noqa: E402

SHAPES = ("4096x14336", "28672x4096", "8192x8192")  # N x K: small N / long K, wide N, square
SCHEMES = {"w4a16": "w4a16", "w8a8_int8": "w8a8", "w8a8_fp8": "fp8"}
TILED = (  # block_m, block_n, block_k, num_warps, num_stages
    (16, 128, 128, 4, 4),
    (32, 64, 128, 4, 4),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 8, 3),
    (64, 128, 128, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 64, 128, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
)


def candidates(kernel: str, m: int) -> list[TunedConfig]:
    """Decode tiles (16 rows, K split 0-8 waves; W4A16 one row at M = 1) up to M = 16, larger tiles
    beyond (split 0 or 2 waves up to M = 256), and for W4A16 from M = 64 on also dequantize +
    cuBLAS."""
    if m <= 16:
        block_ks = (128,) if kernel == "w4a16" else (128, 256)
        found = [
            TunedConfig("decode", 16, block_n, block_k, waves, num_warps=4, num_stages=4)
            for block_n in (32, 64, 128)
            for block_k in block_ks
            for waves in (0, 1, 2, 4, 8)
        ]
        if m == 1 and kernel == "w4a16":  # one row: a dot product without tensor cores
            found += [
                TunedConfig("decode", 1, block_n, block_k, waves, num_warps=4, num_stages=3)
                for block_n in (32, 64, 128)
                for block_k in (64, 128)
                for waves in (1, 2, 4, 8)
            ]
        return found
    found = [
        TunedConfig("tiled", bm, bn, bk, waves, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in TILED
        for waves in ((0, 2) if m <= 256 else (0,))  # enough output tiles beyond: no split
        if bm <= m and (m <= 64 or bm >= 64)
    ]
    if kernel == "w4a16":
        found += [TunedConfig("dequant", 0, 64, bk) for bk in (64, 128)]
    return found


def rule_config(kernel: str, m: int, n: int, k: int, device: torch.device) -> TileConfig:
    """What the built-in rule launches (no table)."""
    if kernel == "w4a16":
        return w4a16.choose_config(m, n, k, 128, device)
    return w8a8.choose_config(m, n, k, kernel == "w8a8_fp8", device)


def run_with(kernel: str, module: QuantizedLinear, config: TileConfig) -> Variant:
    """x -> the kernel's product with `module`'s weight under `config`."""
    matmul = w4a16.w4a16_matmul if kernel == "w4a16" else w8a8.w8a8_matmul
    return functools.partial(matmul, weight=module.layout, config=config)


def tune_shape(
    kernel: str, shape: tuple[int, int], batches: list[int], trials: int, device: torch.device
) -> list[dict]:
    """Every candidate at every M for one N x K: its resolved launch, error and time."""
    n, k = shape
    module = synthetic_linear(
        Shape(1, n, k), get_scheme(SCHEMES[kernel]), device, torch.bfloat16, triton=True
    )
    copies = [module] + [
        copy.deepcopy(module) for _ in range(copies_for(module.packed_bytes, device) - 1)
    ]
    weight = module.dequantized_weight(torch.float32)
    activations = None if kernel == "w4a16" else ("fp8" if kernel == "w8a8_fp8" else "int8")
    cells = []
    for m in batches:
        rule = rule_config(kernel, m, n, k, device)
        seen: dict[TileConfig, dict] = {}
        for tuned in candidates(kernel, m):
            config = tuned.resolve(m, n, k, device, 128 if kernel == "w4a16" else None)
            if config not in seen:
                calls = [run_with(kernel, mod, config) for mod in copies]
                try:
                    seen[config] = measure(calls, weight, m, k, activations, device, trials=trials)
                except Exception as exc:  # a config that fails to compile or launch
                    seen[config] = {"error": None, "us": None, "failed": str(exc)[:200]}
            cells.append(
                {"kernel": kernel, "n": n, "k": k, "m": m, "tuned": dataclasses.asdict(tuned),
                 "launch": dataclasses.asdict(config), "rule": config == rule, **seen[config]}
            )  # fmt: skip
        if rule not in seen:  # the rule's own launch is always timed, for the comparison
            calls = [run_with(kernel, mod, rule) for mod in copies]
            row = measure(calls, weight, m, k, activations, device, trials=trials)
            cells.append(
                {"kernel": kernel, "n": n, "k": k, "m": m, "tuned": None,
                 "launch": dataclasses.asdict(rule), "rule": True, **row}
            )  # fmt: skip
    return cells


def choose(cells: list[dict]) -> tuple[dict[str, dict[int, TunedConfig]], list[str]]:
    """Per kernel and M: the candidate (timed correctly on every shape) with the lowest
    geometric mean of time / best time on that shape; and a summary line each against the
    built-in rule."""
    table: dict[str, dict[int, TunedConfig]] = {}
    lines = []
    keys = sorted({(c["kernel"], c["m"]) for c in cells}, key=lambda km: (km[0], km[1]))
    for kernel, m in keys:
        here = [c for c in cells if c["kernel"] == kernel and c["m"] == m]
        shapes = sorted({(c["n"], c["k"]) for c in here})
        best = {s: min(c["us"] for c in here if (c["n"], c["k"]) == s and c["us"]) for s in shapes}

        def score(rows: list[dict], best: dict = best) -> float:
            return math.exp(
                sum(math.log(r["us"] / best[(r["n"], r["k"])]) for r in rows) / len(rows)
            )

        by_tuned: dict[str, list[dict]] = {}
        for c in here:
            if c["tuned"] is not None:
                by_tuned.setdefault(json.dumps(c["tuned"], sort_keys=True), []).append(c)
        complete = {
            key: rows
            for key, rows in by_tuned.items()
            if len(rows) == len(shapes) and all(r["us"] for r in rows)
        }
        if not complete:
            lines.append(f"{kernel:10} M={m:<5} no candidate ran correctly on every shape")
            continue
        winner = min(complete, key=lambda key: score(complete[key]))
        table.setdefault(kernel, {})[m] = TunedConfig(**json.loads(winner))
        rule_rows = [c for c in here if c["rule"] and c["us"]]
        rule_rows = list({(r["n"], r["k"]): r for r in rule_rows}.values())
        gain = score(rule_rows) / score(complete[winner]) if len(rule_rows) == len(shapes) else 0
        lines.append(
            f"{kernel:10} M={m:<5} {winner}  {gain:.2f}x the built-in rule (geomean over "
            f"{len(shapes)} shapes)"
        )
    return table, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated NxK")
    parser.add_argument("--m", default=",".join(map(str, M_BUCKETS)), help="comma-separated M")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "out" / "tuning"))
    parser.add_argument(
        "--device", default="cuda", help="cuda; cpu smoke-tests this script (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "no GPU here: tuning needs one (--device cpu smoke-tests the script)", file=sys.stderr
        )
        sys.exit(2)
    if os.environ.get(TUNING_ENV):
        print(
            f"unset {TUNING_ENV}: candidates are compared with the built-in rule", file=sys.stderr
        )
        sys.exit(2)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    batches = [int(v) for v in args.m.split(",")]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu smoke test"
    about = {
        "gpu": gpu, "torch": torch.__version__, "triton": __import__("triton").__version__,
        "measured": datetime.date.today().isoformat(), "shapes": args.shapes,
        "command": "python benchmarks/tune_kernels.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells: list[dict] = []
    started = time.perf_counter()
    for kernel in args.kernels.split(","):
        for shape in shapes:
            cells += tune_shape(kernel, shape, batches, args.trials, device)
            print(f"{kernel} {shape}: {time.perf_counter() - started:.0f} s", flush=True)
        table, lines = choose(cells)  # saved after each kernel: a run cut short keeps them
        (out / "cells.json").write_text(json.dumps(cells))
        (out / f"{table_name(gpu)}.json").write_text(table_json(table, **about))
    print("\n".join(lines))
    print(f"wrote {out / (table_name(gpu) + '.json')}")


if __name__ == "__main__":
    main()
