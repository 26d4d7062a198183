"""reused_heap: freed multi-megabyte blocks are reused instead of page-faulted in again."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys

import pytest

# 20 blocks of 40 MB (over glibc's 32 MB cap for its own threshold adjustment), each allocated,
# touched and freed as a torch op's output is; prints the page faults they cost
_WORKLOAD = """
import ctypes, ctypes.util, resource, sys
from contextlib import nullcontext
from llmq.heap import reused_heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 40 << 20
with reused_heap() if sys.argv[1] == "reused" else nullcontext():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", _WORKLOAD, mode], capture_output=True, text=True, check=True
    )
    return int(run.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_freed_blocks_are_reused_instead_of_faulted_in_again() -> None:
    pages = (40 << 20) // resource.getpagesize()
    assert _faults("default") > 15 * pages  # glibc maps and unmaps each block
    assert _faults("reused") < 2 * pages  # the first block's pages, then reuse


def test_reused_buffers_hand_out_one_slot_memory_again() -> None:
    import torch

    from llmq.heap import ReusedBuffers

    buffers = ReusedBuffers()
    like = torch.empty(0)
    first = buffers.take("capture", (4, 8), like)
    first.fill_(1.0)
    again = buffers.take("capture", (2, 8), like)  # smaller: the front of the same memory
    assert again.data_ptr() == first.data_ptr() and again.shape == (2, 8)
    assert bool((again == 1.0).all())  # uninitialized: what the slot held, not zeros
    other = buffers.take("kept", (4, 8), like)
    assert other.data_ptr() != first.data_ptr()  # slots never share memory
    larger = buffers.take("capture", (8, 8), like)
    assert larger.shape == (8, 8) and larger.numel() == 64
    wide = buffers.take("capture", (8, 8), torch.empty(0, dtype=torch.float64))
    assert wide.dtype == torch.float64  # another dtype: fresh memory of that dtype
