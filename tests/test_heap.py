"""reused_heap: freed multi-megabyte blocks are reused instead of page-faulted in again."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys

import pytest

# Blocks allocated, touched and freed as a torch op's output is; prints the page faults they cost.
# "default" and "reused": 20 blocks of 40 MB (over glibc's 32 MB cap for its own threshold
# adjustment) outside and inside reused_heap. "after": 20 blocks of 4 MB once reused_heap is
# left, and the resident MB that leaving it handed back (5 freed 40 MB blocks, kept inside).
# "nested": 20 blocks of 40 MB inside reused_heap after a nested reused_heap was left.
_WORKLOAD = """
import ctypes, ctypes.util, resource, sys
from contextlib import nullcontext
from llmq.heap import reused_heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block

def faults_of_blocks(size):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        libc.free(touched(size))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def resident_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() >> 20

if sys.argv[1] == "after":
    with reused_heap():
        for block in [touched(40 << 20) for _ in range(5)]:
            libc.free(block)
        kept = resident_mb()
    print(faults_of_blocks(4 << 20), kept - resident_mb())
elif sys.argv[1] == "nested":
    with reused_heap():
        with reused_heap():
            pass
        print(faults_of_blocks(40 << 20))
else:
    with reused_heap() if sys.argv[1] == "reused" else nullcontext():
        print(faults_of_blocks(40 << 20))
"""


def _workload(mode: str) -> list[int]:
    run = subprocess.run(
        [sys.executable, "-c", _WORKLOAD, mode], capture_output=True, text=True, check=True
    )
    return [int(word) for word in run.stdout.split()]


glibc_only = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's"
)


@glibc_only
@pytest.mark.process
def test_freed_blocks_are_reused_instead_of_faulted_in_again() -> None:
    pages = (40 << 20) // resource.getpagesize()
    assert _workload("default")[0] > 15 * pages  # glibc maps and unmaps each block
    assert _workload("reused")[0] < 2 * pages  # the first block's pages, then reuse


@glibc_only
@pytest.mark.process
def test_leaving_hands_memory_back_and_keeps_later_blocks_unfaulted() -> None:
    faults, released_mb = _workload("after")
    # 4 MB blocks come from the heap after the exit, as glibc's own adjustment would have them
    # (a threshold put back to 128 KB mapped and faulted in each one: 20 x 1024 pages)
    assert faults < 2 * (4 << 20) // resource.getpagesize()
    assert released_mb >= 150  # most of the 200 MB of kept free blocks


@glibc_only
@pytest.mark.process
def test_a_nested_exit_keeps_the_outer_settings() -> None:
    assert _workload("nested")[0] < 2 * (40 << 20) // resource.getpagesize()


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
