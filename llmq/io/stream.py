"""A safetensors file written tensor by tensor, as each tensor is ready.

safetensors' `save_file` takes every tensor of a file at once, so a converter that saves with it
holds a whole output shard in memory. `streamed_safetensors` reserves room for the header at the
start of the file, appends each tensor's bytes when it comes (in whatever order the work
finishes), and writes the header into that room at the end, padded with spaces as safetensors
pads its own. Memory is the tensors not yet written, not the shard. A tensor copied unchanged
from another safetensors file (`FileBytes`) is copied file to file by the kernel
(`copy_file_range`), never mapped or read into memory.

Readers view each tensor at its offset, so an offset must be a multiple of the element size.
A tensor whose byte count is a multiple of 8 keeps the next offset aligned and is written at
once; any other is held back and written at the end, widest elements first, which keeps every
offset aligned (the order safetensors itself uses). A header bigger than the room reserved (the
room is an estimate from the names) is written once more with the data copied behind it.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmq.io.atomic import PARTIAL_SUFFIX, file_mode, partial_file
from llmq.io.checkpoint import HeaderEntry, safetensors_dtype, torch_dtype

if TYPE_CHECKING:
    import torch

_ALIGNMENT = 8  # safetensors pads its header to 8 bytes; tensors of 8k bytes keep that
_ROOM_PER_ENTRY = 160  # JSON of one entry beyond its name: dtype, a 4-D shape, two 12-digit offsets
_COPY_CHUNK = 64 << 20
# copy_file_range cannot copy between these files (another file system, an old kernel)
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}


@dataclass(frozen=True, slots=True)
class FileBytes:
    """A tensor stored in a safetensors file, to be copied unchanged."""

    path: Path
    entry: HeaderEntry


def header_room(names: list[str], entries_per_name: int = 1) -> int:
    """Bytes to reserve for the header of a file holding `entries_per_name` tensors named after
    each of `names` (a quantized weight becomes several: codes, scales, zero points...)."""
    per_name = sum(len(name) + _ROOM_PER_ENTRY for name in names)
    return _aligned(64 + entries_per_name * per_name)


class StreamedSafetensors:
    """The open file of `streamed_safetensors`: `add` writes (or holds back) one tensor."""

    def __init__(self, fd: int, path: Path, room: int) -> None:
        self._fd, self._path, self._room = fd, path, room
        self._entries: dict[str, dict[str, object]] = {}
        self._held: dict[str, torch.Tensor | FileBytes] = {}
        self._end = 0  # bytes of tensor data written

    def add(self, name: str, tensor: torch.Tensor | FileBytes) -> None:
        if name in self._entries or name in self._held:
            raise ValueError(f"tensor {name} added twice")
        if _nbytes(tensor) % _ALIGNMENT:
            self._held[name] = tensor
        else:
            self._write(name, tensor)

    def finish(self, metadata: dict[str, str] | None) -> None:
        """Write the held-back tensors, widest elements first, and the header."""
        for name in sorted(self._held, key=lambda name: -_itemsize(self._held[name])):
            self._write(name, self._held[name])
        self._held.clear()
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        header.update(self._entries)
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > self._room:
            self._move_data(_aligned(len(text)))
        _write_at(self._fd, struct.pack("<Q", self._room) + text.ljust(self._room, b" "), 0)

    def _write(self, name: str, tensor: torch.Tensor | FileBytes) -> None:
        nbytes = _nbytes(tensor)
        self._entries[name] = {
            "dtype": _dtype(tensor),
            "shape": list(tensor.entry.shape if isinstance(tensor, FileBytes) else tensor.shape),
            "data_offsets": [self._end, self._end + nbytes],
        }
        at = 8 + self._room + self._end
        if isinstance(tensor, FileBytes):
            with tensor.path.open("rb") as source:
                _copy(source.fileno(), tensor.entry.start, self._fd, at, nbytes)
        elif nbytes:
            _write_at(self._fd, _bytes_of(tensor), at)
        self._end += nbytes

    def _move_data(self, room: int) -> None:
        """Copy the data behind a room of `room` bytes (the estimate fell short): into a new
        file that replaces this one."""
        moved = grown_name(self._path)
        fd = os.open(moved, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _copy(self._fd, 8 + self._room, fd, 8 + room, self._end)
            os.replace(moved, self._path)
        except BaseException:
            os.close(fd)
            moved.unlink(missing_ok=True)
            raise
        os.close(self._fd)
        self._fd, self._room = fd, room

    def close(self) -> None:
        os.close(self._fd)


@contextmanager
def streamed_safetensors(
    path: Path, room: int, metadata: dict[str, str] | None = None
) -> Iterator[StreamedSafetensors]:
    """A safetensors file at `path`, written under a temporary name and renamed whole when the
    block succeeds (removed when it fails). `room`: bytes reserved for the header
    (`header_room`)."""
    with partial_file(path) as partial:
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        writer = StreamedSafetensors(fd, partial, _aligned(room))
        try:
            yield writer
            writer.finish(metadata)
        finally:
            writer.close()
        os.chmod(partial, file_mode())


def grown_name(partial: Path) -> Path:
    """Where a partial file's data moves behind a larger header: another partial file's name,
    so that an interrupted run's leftover is removed before its folder is published."""
    return partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX) + "0" + PARTIAL_SUFFIX)


def _nbytes(tensor: torch.Tensor | FileBytes) -> int:
    if isinstance(tensor, FileBytes):
        return tensor.entry.nbytes
    return tensor.numel() * tensor.element_size()


def _itemsize(tensor: torch.Tensor | FileBytes) -> int:
    if isinstance(tensor, FileBytes):
        return torch_dtype(tensor.entry.dtype).itemsize
    return tensor.element_size()


def _dtype(tensor: torch.Tensor | FileBytes) -> str:
    return tensor.entry.dtype if isinstance(tensor, FileBytes) else safetensors_dtype(tensor.dtype)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(data.view(torch.uint8).numpy())


def _write_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    """All of `data` at `offset` (a write can be short)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _copy(source: int, start: int, target: int, at: int, nbytes: int) -> None:
    """`nbytes` of file `source` from `start` to file `target` at `at`: in the kernel where it
    can, else through a buffer."""
    done = 0
    while done < nbytes:
        count = min(_COPY_CHUNK, nbytes - done)
        try:
            copied = os.copy_file_range(source, target, count, start + done, at + done)
        except (AttributeError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno not in _NO_KERNEL_COPY:
                raise
            copied = 0
        if not copied:  # no kernel copy here, or a source shorter than its header says
            data = os.pread(source, count, start + done)
            if not data:
                raise OSError(errno.EIO, f"the file ended {nbytes - done} bytes early")
            _write_at(target, data, at + done)
            copied = len(data)
        done += copied


def _aligned(size: int) -> int:
    return -(-size // _ALIGNMENT) * _ALIGNMENT
