"""Where batch-1 decode of a quantized checkpoint spends its time, against its dense twin (the
same weights dequantized to the same dtype). Written for the gap seen on the H200 (2026-11-26):
`llmq bench` decoded 6-15x slower quantized than dense while each quantized linear took 5-60 us
inside a CUDA graph. It answers, in one run:
- per-step decode times of both models (median and spread: a few slow steps mean compilation
  inside the timed run, a uniformly slow median means per-call cost), and how many Triton
  kernels compiled during the timed steps;
- eager cost of one call of the largest quantized linear at M = 1 against `x @ W^T`: time to
  enqueue (CPU) and wall time per call, and the CPU cost of the launch decision alone;
- decode with each step replayed from a CUDA graph (`llmq.runtime.generate`), both models;
- torch.profiler's top operations by self CPU and by GPU time for the quantized decode.

    python benchmarks/profile_decode.py CHECKPOINT [--tokens 32] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llmq
from llmq.api.run import _open
from llmq.kernels import w4a16, w8a8
from llmq.runtime.generate import GraphCaptureError, graphed_greedy_decode, greedy_decode
from llmq.runtime.load import load_dequantized
from llmq.runtime.modules import QuantizedLinear, W4A16Linear

EAGER_CALLS = 200


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def step_seconds(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> list[float]:
    """Wall seconds of each decode step after the prefill (each ends when its token is on the
    host, so the GPU work is done)."""
    out = model(prompt, use_cache=True)
    token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
    int(token)
    steps = []
    for _ in range(tokens):
        started = time.perf_counter()
        out = model(token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        int(token)
        steps.append(time.perf_counter() - started)
    return steps


class GcClock:
    """Seconds Python's garbage collector ran, and its collections per generation, while
    active (gc.callbacks report each collection's start and stop)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def timed_steps(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> dict[str, object]:
    """Decode step statistics, the garbage collector's share, and compiles while timed."""
    before = compiled_kernels()
    with GcClock() as clock:
        steps = summary_ms(step_seconds(model, prompt, tokens))
    return {
        **steps,
        "gc_ms": clock.seconds * 1e3,
        "gc_collections": clock.collections,
        "kernels_compiled_while_timed": compiled_kernels() - before,
    }


def python_profile(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> str:
    """cProfile's top functions by own time over `tokens` decode steps (Python-side cost that
    torch.profiler does not see: the Triton launcher, llmq's dispatch)."""
    profiler = cProfile.Profile()
    profiler.enable()
    step_seconds(model, prompt, tokens)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


@torch.inference_mode()
def eager_tokens(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> list[int]:
    return greedy_decode(model, prompt, max_new_tokens=tokens).tokens


def graphed(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> dict[str, object]:
    """Graph-replayed decode (llmq's, as `llmq bench` times it): step statistics, or why the
    capture failed; and whether its tokens are eager decode's."""
    try:
        graphed_greedy_decode(model, prompt, max_new_tokens=tokens)  # warm-up
        run = graphed_greedy_decode(model, prompt, max_new_tokens=tokens)
    except GraphCaptureError as exc:
        return {"failed": str(exc)}
    expected = eager_tokens(model, prompt, tokens)
    return {
        "step_ms": run.decode_seconds / run.decode_steps * 1e3,
        "tokens_per_second": run.decode_tokens_per_second,
        "capture_ms": run.capture_seconds * 1e3,
        "tokens_match_eager": sum(a == b for a, b in zip(run.tokens, expected, strict=True)),
        "of": len(expected),
    }


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {
        "median": statistics.median(ms),
        "min": min(ms),
        "max": max(ms),
        "mean": statistics.fmean(ms),
        "tokens_per_second": 1e3 / statistics.fmean(ms),
    }


def compiled_kernels() -> int:
    """Compiled variants held by llmq's Triton kernels (Triton keeps them per device)."""
    total = 0
    for fn in (w4a16._w4a16_kernel, w4a16._dequantize_kernel, *w8a8_kernels()):
        for cache in getattr(fn, "device_caches", {}).values():
            total += len(cache[0]) if isinstance(cache, tuple) else len(cache)
    return total


def w8a8_kernels() -> list:
    return [v for v in vars(w8a8).values() if type(v).__name__ == "JITFunction"]


@torch.inference_mode()
def eager_us(call, calls: int = EAGER_CALLS) -> dict[str, float]:
    """Microseconds per call, eager: to enqueue (CPU time until the loop ends) and wall (until
    the GPU finishes)."""
    for _ in range(10):
        call()
    sync()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    enqueued = time.perf_counter()
    sync()
    done = time.perf_counter()
    return {
        "enqueue_us": (enqueued - started) / calls * 1e6,
        "wall_us": (done - started) / calls * 1e6,
    }


def largest_linear(model: torch.nn.Module) -> tuple[str, QuantizedLinear]:
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    return max(found, key=lambda item: item[1].in_features * item[1].out_features)


def eager_costs(model: torch.nn.Module) -> dict[str, object]:
    """One call of the largest quantized linear at M = 1, eager, against the dense product, and
    the CPU cost of the launch decision alone."""
    name, module = largest_linear(model)
    x = torch.randn(1, module.in_features, device=_device(module))
    x = x.to(torch.bfloat16 if x.is_cuda else torch.float32)
    weight = module.dequantized_weight(x.dtype)
    n, k = module.out_features, module.in_features
    if isinstance(module, W4A16Linear):
        decide = lambda: w4a16.choose_config(1, n, k, module.group_size, x.device)  # noqa: E731
    else:
        fp8 = module.codes.dtype != torch.int8
        decide = lambda: w8a8.choose_config(1, n, k, fp8, x.device)  # noqa: E731
    return {
        "linear": name,
        "label": module.label,
        "shape": f"1x{n}x{k}",
        "quantized": eager_us(lambda: module.matmul(x)),
        "dense": eager_us(lambda: x @ weight.T),
        "launch_decision": eager_us(decide),
        "config": str(decide()),
    }


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.buffers()).device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()
    model = llmq.load_quantized(args.checkpoint)
    first = next(model.parameters())
    dense = load_dequantized(_open(args.checkpoint)).to(device=first.device, dtype=first.dtype)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), device=first.device)
    result: dict[str, object] = {"checkpoint": args.checkpoint, "device": str(first.device)}
    for label, net in (("quantized", model), ("dense", dense)):
        greedy_decode(net, prompt, max_new_tokens=4)  # compile and warm up
        result[label] = timed_steps(net, prompt, args.tokens)
        print(f"{label:9} decode step ms: " + json.dumps(result[label]), flush=True)
    gc.freeze()  # every object alive now leaves the collector's generations
    for label, net in (("quantized", model), ("dense", dense)):
        result[f"{label}_gc_frozen"] = timed_steps(net, prompt, args.tokens)
        print(f"{label:9} gc frozen: " + json.dumps(result[f"{label}_gc_frozen"]), flush=True)
    gc.unfreeze()
    if first.is_cuda:
        for label, net in (("quantized", model), ("dense", dense)):
            result[f"{label}_cuda_graph"] = graphed(net, prompt, args.tokens)
            print(f"{label:9} cuda graph: " + json.dumps(result[f"{label}_cuda_graph"]), flush=True)
    result["python_profile"] = python_profile(model, prompt, 8)
    print(result["python_profile"], flush=True)
    result["eager"] = eager_costs(model)
    print("eager, one call at M=1: " + json.dumps(result["eager"]), flush=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step_seconds(model, prompt, 8)
    table = prof.key_averages()
    result["profile_cpu"] = table.table(sort_by="self_cpu_time_total", row_limit=15)
    print(result["profile_cpu"])
    if torch.cuda.is_available():
        result["profile_gpu"] = table.table(sort_by="self_cuda_time_total", row_limit=12)
        print(result["profile_gpu"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
