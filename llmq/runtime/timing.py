"""Timing a GPU (or CPU) call honestly: weights cold in L2, no CPU launch gaps, medians.

On a GPU, the calls (one per rotating copy of the inputs, so every call reads its weights from
memory rather than from L2) are captured in one CUDA graph; each trial replays the graph enough
times to last `min_trial_seconds`, timed by CUDA events; the result is the median over trials of
the time per call. On the CPU the same calls run in a loop under perf_counter.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

ROTATION_BYTES = 256 * 2**20  # rotate through at least this much weight data (L2 is 50 MB)
MAX_COPIES = 48


def copies_for(weight_bytes: int, device: torch.device) -> int:
    """How many copies of a layer's inputs to rotate through so that its weights are read from
    memory on every call: one on the CPU (its caches are not what is being measured)."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_COPIES, -(-ROTATION_BYTES // max(weight_bytes, 1))))


def median_seconds(
    calls: Sequence[Callable[[], object]],
    device: torch.device,
    *,
    trials: int = 15,
    min_trial_seconds: float = 0.002,
) -> float:
    """Median time of one call, over `trials` trials of the rotating `calls`."""
    for call in calls:  # warm-up: compilation, autotuning caches, allocator
        call()
    if device.type == "cuda":
        return _graph_median(calls, device, trials, min_trial_seconds)
    per_trial = []
    for _ in range(trials):
        started = time.perf_counter()
        for call in calls:
            call()
        per_trial.append((time.perf_counter() - started) / len(calls))
    return statistics.median(per_trial)


def _graph_median(
    calls: Sequence[Callable[[], object]], device: torch.device, trials: int, min_seconds: float
) -> float:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(1, int(min_seconds * 1000 / max(start.elapsed_time(end), 1e-3)))
    per_call = []
    for _ in range(trials):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1000 / (replays * len(calls)))
    return statistics.median(per_call)


def read_bandwidth(device: torch.device, size_bytes: int = ROTATION_BYTES) -> float:
    """Measured read-only memory bandwidth in bytes/s (a sum over a float32 buffer): the roofline
    that `llmq bench` reports each shape against, measured in the same run."""
    data = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    seconds = median_seconds([lambda: data.sum()], device, trials=5)
    return size_bytes / seconds
