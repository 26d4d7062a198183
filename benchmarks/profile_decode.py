"""Where batch-1 decode of a quantized checkpoint spends its time: greedy decode under
torch.profiler, the top operations by self CPU time and by GPU time. Written for the gap seen on
the H200 (2026-11-26): `llmq bench` decoded 6-15x slower quantized than dense while each
quantized linear took 5-60 us inside a CUDA graph.

    python benchmarks/profile_decode.py CHECKPOINT [--tokens 16]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import llmq
from llmq.runtime.generate import greedy_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    model = llmq.load_quantized(args.checkpoint)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32))
    greedy_decode(model, prompt, max_new_tokens=4)  # compile and warm up outside the profile
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run = greedy_decode(model, prompt, max_new_tokens=args.tokens)
    print(f"decode: {run.decode_tokens_per_second:.1f} tokens/s")
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=15))
    if torch.cuda.is_available():
        print(table.table(sort_by="self_cuda_time_total", row_limit=10))


if __name__ == "__main__":
    main()
