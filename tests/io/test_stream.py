"""Safetensors files written tensor by tensor (`llmq.io.stream`), read back by safetensors'
own loader; the read-ahead's advice."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmq.io import readahead, stream
from llmq.io.checkpoint import read_safetensors_header
from llmq.io.stream import FileBytes, header_room, streamed_safetensors


def tensors() -> dict[str, torch.Tensor]:
    """Every dtype llmq writes, odd byte counts (which must be held back for alignment), a
    scalar and an empty tensor."""
    generator = torch.Generator().manual_seed(0)
    return {
        "codes": torch.randint(-128, 127, (5, 7), dtype=torch.int8, generator=generator),
        "fp8": torch.randn(3, 3, generator=generator).to(torch.float8_e4m3fn),
        "scale": torch.randn(5, 1, generator=generator).to(torch.bfloat16),
        "half": torch.randn(3, generator=generator).to(torch.float16),
        "float": torch.randn(4, 3, generator=generator),
        "double": torch.randn(3, dtype=torch.float64, generator=generator),
        "index": torch.arange(5, dtype=torch.int64),
        "shape": torch.tensor([5, 7], dtype=torch.int32),
        "flags": torch.tensor([True, False, True]),
        "bytes": torch.arange(9, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bytes = [t.reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*as_bytes)


def check_alignment(path: Path) -> None:
    """Every tensor starts at a multiple of its element size, and the data after the header
    starts at a multiple of 8."""
    length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert length % 8 == 0
    for name, entry in read_safetensors_header(path).items():
        assert (entry.start - 8 - length) % tensors_itemsize(entry.dtype) == 0, name


def tensors_itemsize(dtype: str) -> int:
    from llmq.io.checkpoint import torch_dtype

    return torch_dtype(dtype).itemsize


def write(path: Path, items: dict[str, torch.Tensor | FileBytes], room: int) -> None:
    with streamed_safetensors(path, room, {"format": "pt"}) as out:
        for name, tensor in items.items():
            out.add(name, tensor)


@pytest.mark.parametrize("room", ["estimated", "too small"])
def test_safetensors_reads_back_every_tensor_in_any_order(tmp_path: Path, room: str) -> None:
    """Tensors added in an order that misaligns them if written as they come; a room that is
    too small moves the data once. safetensors' loader gets the same bytes and metadata."""
    want = tensors()
    path = tmp_path / "out.safetensors"
    write(path, want, header_room(list(want)) if room == "estimated" else 8)
    got = load_file(path)
    assert sorted(got) == sorted(want) and all(same(got[n], want[n]) for n in want)
    with safe_open(path, "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    check_alignment(path)
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


def test_a_grown_files_leftover_is_a_partial_file(tmp_path: Path) -> None:
    """Where a run dies while moving the data behind a larger header, what it leaves is named
    as a partial file, which publishing removes."""
    from llmq.io.atomic import remove_partial_leftovers

    with streamed_safetensors(tmp_path / "out.safetensors", 8) as out:
        out.add("w", torch.zeros(4))
        partial = out._path
    stream.grown_name(partial).write_bytes(b"left over")  # as a killed run leaves it
    assert len(list(tmp_path.iterdir())) == 2
    remove_partial_leftovers(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_stored_tensors_are_copied_from_their_file(
    tmp_path: Path, kernel_copy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`FileBytes` copies a tensor's bytes from another safetensors file, by the kernel or,
    where copy_file_range cannot (another file system), through a buffer."""
    source = tmp_path / "source.safetensors"
    want = tensors()
    save_file(want, source)
    if not kernel_copy:

        def cross_device(*args: object) -> int:
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", cross_device)
    monkeypatch.setattr(stream, "_COPY_CHUNK", 7)  # many pieces
    entries = read_safetensors_header(source)
    path = tmp_path / "out.safetensors"
    write(path, {name: FileBytes(source, entries[name]) for name in want}, header_room(list(want)))
    got = load_file(path)
    assert all(same(got[n], want[n]) for n in want)
    check_alignment(path)


def test_a_source_shorter_than_its_header_says_fails(tmp_path: Path) -> None:
    source = tmp_path / "source.safetensors"
    save_file({"w": torch.zeros(64)}, source)
    entry = read_safetensors_header(source)["w"]
    with source.open("r+b") as handle:
        handle.truncate(entry.start + 16)
    with pytest.raises(OSError, match="ended"):
        write(tmp_path / "out.safetensors", {"w": FileBytes(source, entry)}, 256)
    assert not (tmp_path / "out.safetensors").exists()


def test_a_failed_block_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "out.safetensors"
    with pytest.raises(RuntimeError), streamed_safetensors(path, 256) as out:
        out.add("w", torch.zeros(8))
        raise RuntimeError("the work failed")
    assert list(tmp_path.iterdir()) == []


def test_a_name_added_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="added twice"), streamed_safetensors(tmp_path / "x", 256) as out:  # fmt: skip
        out.add("w", torch.zeros(3, dtype=torch.int8))  # held back (3 bytes)
        out.add("w", torch.zeros(8))


def test_the_header_is_padded_with_spaces_into_its_room(tmp_path: Path) -> None:
    path = tmp_path / "out.safetensors"
    write(path, {"w": torch.ones(2)}, 4096)
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    assert length == 4096 and data[8 : 8 + length].rstrip(b" ").endswith(b"}")
    assert json.loads(data[8 : 8 + length])["w"]["data_offsets"] == [0, 8]


def test_read_ahead_advises_each_range_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranges are handed to posix_fadvise(WILLNEED) in order, from the read-ahead's thread;
    a file that cannot be opened ends that batch quietly (it is advice)."""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, length, advice: (calls.append((start, length, advice)), real(fd, start, length, advice)))  # fmt: skip
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_bytes(bytes(4096))
    second.write_bytes(bytes(4096))
    with readahead.ReadAhead() as ahead:
        ahead.advise([(first, 0, 100), (second, 50, 10), (first, 200, 300)])
        ahead.advise([(tmp_path / "missing", 0, 10), (first, 1, 1)])
        ahead.advise([(second, 7, 7)])
        ahead._thread.shutdown(wait=True)  # the queued advice done
    assert calls == [(0, 100, os.POSIX_FADV_WILLNEED), (50, 10, os.POSIX_FADV_WILLNEED), (200, 300, os.POSIX_FADV_WILLNEED), (7, 7, os.POSIX_FADV_WILLNEED)]  # fmt: skip
