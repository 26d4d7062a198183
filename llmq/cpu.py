"""Threads of torch work sharing the CPU's cores.

A pool of N threads that each run torch ops would, by default, give every op all the cores:
N x cores threads contend for the cores (on 2 cores, two model-free workers each splitting
every op in two ran 20-30% slower than with one thread an op).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def threads_per_worker(workers: int) -> Iterator[None]:
    """Each of `workers` threads' torch ops use its share of the cores, while the block runs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)
