"""GPTQ's column loop on a GPU: the Triton kernel (one launch a block) against torch ops (six or
seven launches a column), on one linear of Llama-3-8B's shapes, in one process.

Each row runs `gptq_quantize_weight` (W4A16 g128, static act order, 1% dampening) on random
float32 weights [out, in] and a Hessian from random activations, once to warm up and then
--repeat times; it reports the median time of each loop, the speedup, the share of codes that
differ and the ratio of GPTQ's losses (the kernel rounds as the CPU's compiled loop, bit for bit
in tests/quant/test_compiled.py; torch's GPU ops may or may not fuse the update's multiply-add,
and one last bit can tip a code). Random weights say nothing about accuracy; this is time only.

    python benchmarks/bench_gptq_loop.py [--shapes 6144x4096 4096x14336] [--repeat 3]

On a machine without a GPU, TRITON_INTERPRET=1 with small --shapes (64x256) tries the script on
the CPU (the kernel in Triton's interpreter, against the torch loop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import torch

from llmq.config import QuantArgs
from llmq.quant import gptq
from llmq.quant.gptq_triton import quantize_columns_gpu

W4_G128 = QuantArgs(num_bits=4, strategy="group", group_size=128)


def timed(device: torch.device, loop: str, weight, hessian, repeat: int):
    """The median seconds of `repeat` runs of one loop, and its last result."""
    kernel = quantize_columns_gpu if loop == "triton" else None
    seconds, result = [], None
    with (
        mock.patch.object(gptq, "_gpu_column_loop", lambda *_: kernel),
        mock.patch.object(gptq, "compiled_loop_applies", lambda *_: False),
    ):
        for attempt in range(repeat + 1):  # the first warms up (Triton compiles)
            sync(device)
            started = time.perf_counter()
            result = gptq.gptq_quantize_weight(weight, hessian, W4_G128)
            sync(device)
            if attempt:
                seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["6144x4096", "4096x14336"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device).manual_seed(0)
    for shape in args.shapes:
        rows, cols = (int(n) for n in shape.split("x"))
        weight = torch.randn(rows, cols, device=device, generator=generator) * 0.02
        x = torch.randn(args.tokens, cols, device=device, generator=generator)
        hessian = 2 * x.T @ x / args.tokens
        torch_s, expected = timed(device, "torch", weight, hessian, args.repeat)
        triton_s, got = timed(device, "triton", weight, hessian, args.repeat)
        differing = (got.weight.codes != expected.weight.codes).float().mean().item()
        loss_ratio = (got.row_loss.sum() / expected.row_loss.sum()).item()
        print(json.dumps({
            "shape": shape, "device": torch.cuda.get_device_name() if device.type == "cuda"
            else "cpu (interpreter)", "torch_loop_s": round(torch_s, 4),
            "triton_loop_s": round(triton_s, 4), "speedup": round(torch_s / triton_s, 2),
            "codes_differing": differing, "loss_ratio": round(loss_ratio, 6),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
