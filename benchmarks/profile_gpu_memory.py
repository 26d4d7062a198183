"""Where a staged GPTQ layer's GPU memory goes: each step's peak allocation, in one process.

Runs `llmq quantize` in this process with the pipeline's steps wrapped (the embedding, each
stage's observation pass, the linears' quantization, the RTN comparison, the output pass): each
wrapper resets CUDA's peak counter, calls the step, and records the memory allocated before, the
peak during and the memory allocated after, in GB. It prints one JSON line per step name with
the largest peak it reached (a nested step's peak counts for the step around it too), then the
largest peak of all and the memory the caching allocator holds at the end.

    python benchmarks/profile_gpu_memory.py MODEL CALIB_TEXT [llmq quantize options...]

Allocated memory is what tensors hold; reserved adds the blocks the caching allocator keeps for
reuse (what nvidia-smi and the benchmarks' sampler see).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import tempfile
from collections import defaultdict

import torch

import llmq.pipeline.staged as staged
from llmq.calib.stream import LayerStream
from llmq.cli.main import app

GB = 1e9
STEPS = {
    staged: ("observe_until", "quantize_linears", "rtn_layer_error", "rtn_weights"),
    LayerStream: ("embed", "run_layer", "load_layer"),
}
peaks: dict[str, dict[str, float]] = defaultdict(dict)
outer: list[int] = []  # the peak each enclosing step had reached when a nested one began


def measured(name: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if outer:  # a nested step resets the counter: keep what the enclosing one reached
            outer[-1] = max(outer[-1], torch.cuda.max_memory_allocated())
        outer.append(0)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            return function(*args, **kwargs)
        finally:
            peak = max(torch.cuda.max_memory_allocated(), outer.pop())
            if outer:
                outer[-1] = max(outer[-1], peak)
            record = peaks[name]
            if peak / GB > record.get("peak_gb", 0.0):
                record.update(peak_gb=round(peak / GB, 2), before_gb=round(before / GB, 2),
                              after_gb=round(torch.cuda.memory_allocated() / GB, 2))  # fmt: skip
            record["calls"] = record.get("calls", 0) + 1

    return wrapper


def main() -> None:
    model, calib, *options = sys.argv[1:]
    for owner, names in STEPS.items():
        for name in names:
            setattr(owner, name, measured(name, getattr(owner, name)))
    with tempfile.TemporaryDirectory() as out:
        argv = ["quantize", model, "--out", f"{out}/q", "--scheme", "w4a16", "--method", "gptq",
                "--calib-text", calib, "--device", "cuda", "--no-reference", "--json", *options]  # fmt: skip
        with contextlib.suppress(SystemExit):
            app(argv, standalone_mode=False)
    for name, record in peaks.items():
        print(json.dumps({"step": name, **record}))
    print(json.dumps({
        "max_step_peak_gb": max(record.get("peak_gb", 0.0) for record in peaks.values()),
        "reserved_at_end_gb": round(torch.cuda.memory_reserved() / GB, 2),
        "options": options,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
