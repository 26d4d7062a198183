#!/usr/bin/env python3
"""Convert a safetensors checkpoint with llm-compressor's `model_free_ptq` (peer runner).

Runs INSIDE benchmarks/.venvs/llmcompressor (see setup_llmcompressor.sh); it is never imported
by llmq. Quantizes the checkpoint's linear weights tensor by tensor with one of llm-compressor's
data-free presets, without building the model, on the CPU with --workers threads, and prints ONE
JSON line with the conversion's seconds on stdout (imports excluded). Everything else goes to
stderr.

Example:
    benchmarks/.venvs/llmcompressor/bin/python benchmarks/peers/llmcompressor_model_free.py \
        --model /tmp/model --out /tmp/out-fp8 --scheme FP8_DYNAMIC --workers 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scheme", default="FP8_DYNAMIC", help="a data-free preset (FP8_DYNAMIC, W8A16, ...)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):
        from llmcompressor import model_free_ptq

        started = time.perf_counter()
        # the router of a mixture stays in float, as the layer-by-layer presets keep it
        model_free_ptq(
            args.model, args.out, scheme=args.scheme, ignore=["lm_head", "re:.*mlp.gate$"],
            max_workers=args.workers, device="cpu",
        )  # fmt: skip
        seconds = time.perf_counter() - started
    print(json.dumps({"tool": "llm-compressor", "scheme": args.scheme, "seconds": seconds}))


if __name__ == "__main__":
    main()
