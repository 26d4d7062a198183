"""The loss backward behind `--sensitivity gradient` and `fisher` on the default model: llmq's
layer-streamed backward (`llmq.mixed.backward`) against the whole-model backward it replaced
(transformers' model in float32 with its gradients, one window at a time), over the same
windows of held-out pydoc, each in its own measured process: seconds of the passes and the
process's peak RSS.

    python benchmarks/bench_sensitivity.py [--windows 8] [--seq-len 512] [--out benchmarks/out/sensitivity]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HERE, machine, run_measured, write_json

RUNS = ("streamed", "whole-model")


def windows(count: int, seq_len: int) -> torch.Tensor:
    from llmq.calib.data import evaluation_windows
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.models import builtin_model_path

    tokenizer = load_tokenizer(builtin_model_path("smollm2-135m"))
    return evaluation_windows(tokenizer, "pydoc", seq_len=seq_len, max_windows=count).input_ids


def child(run: str, count: int, seq_len: int) -> None:
    """One run in this process: print its seconds as JSON."""
    import torch

    from llmq.models import builtin_model_path

    path, input_ids = builtin_model_path("smollm2-135m"), windows(count, seq_len)
    started = time.perf_counter()
    if run == "streamed":
        from llmq.io.checkpoint import open_checkpoint
        from llmq.mixed.backward import backward_by_layer

        backward_by_layer(open_checkpoint(path), input_ids, lambda *_: nullcontext())
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for window in input_ids:
            loss = model(input_ids=window[None], labels=window[None]).loss
            (loss * (len(window) - 1)).backward()
            model.zero_grad(set_to_none=True)
    print(json.dumps({"seconds": time.perf_counter() - started}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=HERE / "out" / "sensitivity")
    parser.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.windows, args.seq_len)
        return
    rows = []
    for run in RUNS:
        options = ["--windows", str(args.windows), "--seq-len", str(args.seq_len)]
        measured = run_measured([sys.executable, __file__, "--child", run, *options])
        seconds = json.loads(measured.stdout.strip().splitlines()[-1])["seconds"]
        rows.append({"run": run, "seconds": round(seconds, 1), "wall_s": round(measured.wall_s, 1),
                     "peak_rss_gb": round(measured.peak_rss_bytes / 1e9, 2)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "windows": args.windows,
              "seq_len": args.seq_len, "rows": rows}  # fmt: skip
    write_json(args.out / "results.json", report)
    print("| run | backward passes s | process wall s | peak RSS GB |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['run']} | {row['seconds']} | {row['wall_s']} | {row['peak_rss_gb']} |")


if __name__ == "__main__":
    main()
