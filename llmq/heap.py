"""Keep freed memory for reuse while streaming work allocates the same chunk-sized tensors
over and over.

glibc hands every freed block over 128 KB back to the kernel, so each new multi-megabyte
tensor page-faults in fresh zeroed memory: elementwise work on 1M-element chunks runs 5-7x
slower than on memory already mapped, and a CPU forward pass of a decoder layer over 4 x 512
tokens (every op's output a new tensor) 5-7% slower. Inside `reused_heap()` blocks up to 64 MB
come from the heap and stay there. Leaving it hands the kept free memory back (`malloc_trim`)
and leaves the thresholds where glibc's own adjustment takes them after large frees: setting
any threshold switches that adjustment off for good, so restoring the 128 KB start value would
page-fault every later block over 128 KB (tensor statistics after such an exit ran 3.6x
slower: 23.7 against 6.4 ns a value). Nested blocks (a scan inside a quantization, say) keep
the outer block's settings: only the outermost exit restores. Elsewhere (macOS, musl) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_ADJUSTED_MAX = 32 << 20  # the highest mmap threshold glibc's own adjustment sets
_KEEP_BLOCKS_UP_TO = 64 << 20
_KEEP_FREE_UP_TO = 256 << 20
_depth = 0  # reused_heap blocks open now, in any thread (the thresholds are process-wide)
_depth_lock = threading.Lock()


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the one with mallopt and malloc_trim), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@contextmanager
def reused_heap() -> Iterator[None]:
    global _depth
    libc = _glibc()
    if libc is None:
        yield
        return
    with _depth_lock:
        _depth += 1
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BLOCKS_UP_TO)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREE_UP_TO)
    try:
        yield
    finally:
        with _depth_lock:
            _depth -= 1
            if not _depth:
                libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_ADJUSTED_MAX)
                libc.mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_ADJUSTED_MAX)  # glibc: 2x the above
                libc.malloc_trim(0)


class ReusedBuffers:
    """Activation-sized tensors that a layer loop needs again for every layer, kept from one
    layer to the next under a slot name.

    Blocks over the heap's 64 MB stay outside it: a fresh tensor of all samples' activations
    (the default model's MLP inputs over 128 x 512 tokens are 400 MB) page-faults on every
    first write, layer after layer. Reusing one page-faulted buffer cut a staged GPTQ layer's
    minor faults by half and its time by ~3.5% on a 2-core CPU.

    A slot holds one tensor at a time: `take` hands out the slot's memory again, so the
    previous tensor taken from it must be dead by then.
    """

    def __init__(self) -> None:
        self._slots: dict[str, Tensor] = {}

    def take(self, slot: str, shape: Sequence[int], like: Tensor) -> Tensor:
        """An uninitialized tensor of `shape` with `like`'s dtype and device, from `slot`."""
        numel = math.prod(shape)
        held = self._slots.get(slot)
        if held is None or not _can_serve(held, numel, like):
            self._slots.pop(slot, None)  # freed before its larger successor is allocated
            held = self._slots[slot] = like.new_empty(numel)
        return held[:numel].view(*shape)

    def held_bytes(self) -> int:
        return sum(held.numel() * held.element_size() for held in self._slots.values())


def _can_serve(held: Tensor, numel: int, like: Tensor) -> bool:
    return held.numel() >= numel and (held.dtype, held.device) == (like.dtype, like.device)
