"""Open a Hugging Face checkpoint folder without reading its tensors.

`open_checkpoint` validates everything that can be validated cheaply (config.json, the shard
index, every shard's header against its file size) so that bad input fails before any work.
Tensors are read later, one at a time, from the memory-mapped shards.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.errors import InputError, UnsupportedModelError
from llmq.io.family import BUILT_AS, FAMILY_LAYOUT, layout_for_config
from llmq.io.fp8_release import show_bfloat16
from llmq.io.fused_experts import show_per_expert
from llmq.io.layout import DecoderLayout
from llmq.io.record import RECORD_FILE, OutputRecord
from llmq.io.views import ShownTensors, TensorView

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip


RUN_RECORD_FILE = "llmq-run.json"  # what an `llmq run` into a folder has finished
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def recorded_sparsity(folder: Path) -> float | None:
    """The share of zeros `llmq prune` (or a pruning `quantize`) recorded for the linears."""
    try:
        return float(OutputRecord.read(folder).sparsity["linears"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None


def side_files(folder: Path) -> list[Path]:
    """A checkpoint's files that a converted copy keeps as they are (tokenizer, generation
    config, chat template, license...): everything but weights, config, index and llmq's record."""
    return [
        path
        for path in sorted(folder.iterdir())
        if path.is_file()
        and not path.name.endswith(_WEIGHT_FILES)
        and path.name not in ("config.json", "model.safetensors.index.json", RECORD_FILE)
    ]


# safetensors dtype strings and the torch dtypes' names
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
    "U64": "uint64",
}  # fmt: skip


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string ("BF16" -> torch.bfloat16)."""
    import torch

    return getattr(torch, _DTYPES[dtype])


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype (torch.bfloat16 -> "BF16")."""
    names = {value: key for key, value in _DTYPES.items()}
    name = str(dtype).removeprefix("torch.")
    if name not in names:
        raise ValueError(f"safetensors stores no {name} tensors")
    return names[name]


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """A tensor's entry in a safetensors header, checked against the file."""

    dtype: str  # safetensors dtype string, e.g. "F32", "BF16", "I32"
    shape: tuple[int, ...]
    start: int  # where its bytes begin in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor's entry in a shard header: enough to plan work without reading data."""

    shard: Path
    dtype: str  # safetensors dtype string, e.g. "F32", "BF16", "I32"
    shape: tuple[int, ...]


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint folder: config, family layout and where every tensor lives."""

    path: Path
    config: dict[str, Any]
    layout: DecoderLayout
    tensors: dict[str, TensorInfo]  # as shown: stored, or views over hidden ones
    # stored tensors shown through views (llmq.io.views): GPT-OSS's fused experts, FP8 codes
    hidden: dict[str, TensorInfo] = field(default_factory=dict)
    views: dict[str, TensorView] = field(default_factory=dict)
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def decoder_linears(self) -> list[str]:
        """Every decoder layer's linear module names, layer by layer."""
        return [name for i in range(self.num_layers) for name in self.layout.linear_names(i)]

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        return self.config.get("quantization_config")

    @property
    def tied_embeddings(self) -> bool:
        return f"{self.layout.lm_head}.weight" not in self.tensors

    def model_config(self) -> Any:
        """The transformers config of the architecture, without `quantization_config`: llmq
        builds plain float modules and applies (or simulates) the quantization itself; a
        model_type of `BUILT_AS` as the architecture transformers knows (no remote code)."""
        from transformers import AutoConfig

        plain = {
            k: v for k, v in self.config.items() if k not in ("quantization_config", "auto_map")
        }
        plain["model_type"] = BUILT_AS.get(plain.get("model_type"), plain.get("model_type"))
        return AutoConfig.for_model(**plain)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> torch.Tensor:
        """One tensor as shown: as stored, read from the memory-mapped shard, or computed by
        its view from the stored ones (llmq.io.views)."""
        view = self.views.get(name)
        if view is not None:
            return view.read(self._read_stored)
        if name not in self.tensors:
            raise InputError(f"{self.path}: tensor {name!r} is missing")
        return self._read_stored(name)

    def _read_stored(self, name: str, index: int | None = None) -> torch.Tensor:
        """Stored tensor `name`, or only its entry `index` along the first dimension."""
        info = self.hidden.get(name) or self.tensors[name]
        handle = self._handle(info.shard)
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index : index + 1][0]

    def _handle(self, shard: Path) -> Any:
        handle = self._handles.get(shard)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(shard), framework="pt")
            self._handles[shard] = handle
        return handle

    def file_stamps(self) -> dict[str, Any]:
        """Where the checkpoint is and the size and mtime of every shard: what resume states and
        cached results are keyed on, so that changed weights never reuse them."""
        return file_stamps(self.path, self.tensors)

    def names_with_prefix(self, prefix: str) -> Iterator[str]:
        return (name for name in self.tensors if name.startswith(prefix))

    def close(self) -> None:
        """Drop the shard handles (reads reopen them). Tensors already read stay valid: each
        keeps its shard's mapping alive until it is freed."""
        self._handles.clear()


def file_stamps(folder: Path, tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    """Where a checkpoint is, and the size and mtime of each shard holding `tensors`."""
    shards = sorted({info.shard for info in tensors.values()})
    return {
        "path": str(folder.resolve()),
        "shards": {s.name: [s.stat().st_size, s.stat().st_mtime_ns] for s in shards},
    }


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Validate a checkpoint folder and index its tensors; reads headers only."""
    folder = checkpoint_folder(path)
    config = read_config(folder)
    layout = layout_for_config(config)
    tensors = stored_tensors(folder)
    if layout.discovered:  # module names found in transformers' tree must be the file's names
        stored = {name.rpartition(".")[0] for name in tensors}  # weight, weight_packed, ...
        missing = [name for name in layout.linear_names(0) if name not in stored]
        if missing:
            raise UnsupportedModelError(
                f"{folder}: the layout found for model_type {config.get('model_type')!r} names "
                f"linears the checkpoint does not store ({', '.join(missing[:3])})",
                hint=f"families llmq knows by name: {', '.join(sorted(FAMILY_LAYOUT))}",
            )
    shown = ShownTensors(tensors)
    config = show_bfloat16(shown, config)
    show_per_expert(shown, layout, int(config.get("num_hidden_layers") or 0))
    return Checkpoint(
        path=folder, config=config, layout=layout, tensors=shown.shown, hidden=shown.hidden,
        views=shown.views,
    )  # fmt: skip


def checkpoint_folder(path: str | Path) -> Path:
    """`path` as a checkpoint folder: InputError when it is missing or a file."""
    folder = Path(path)
    if not folder.exists():
        raise InputError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise InputError(
            f"{folder}: not a folder", hint="MODEL is a Hugging Face checkpoint folder"
        )
    return folder


def stored_tensors(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the folder's shards (those its index names, or all .safetensors), from
    the checked headers; the index must agree with them."""
    tensors: dict[str, TensorInfo] = {}
    for shard in _shard_files(folder):
        for name, entry in read_safetensors_header(shard).items():
            tensors[name] = TensorInfo(shard=shard, dtype=entry.dtype, shape=entry.shape)
    _check_index_matches(folder, tensors)
    return tensors


def read_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InputError(
            f"{folder}: no config.json", hint="MODEL is a Hugging Face checkpoint folder"
        )
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InputError(f"{config_path}: expected a JSON object")
    return config


def _shard_files(folder: Path) -> list[Path]:
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        shards = sorted({folder / shard for shard in read_index(index_path).values()})
        for shard in shards:
            if not shard.is_file():
                raise InputError(f"{shard}: {absent_shard(shard)}")
        return shards
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise InputError(
            f"{folder}: no .safetensors files", hint="llmq reads safetensors checkpoints only"
        )
    return shards


def read_index(index_path: Path) -> dict[str, str]:
    """The weight_map of a safetensors index: tensor name -> shard file name."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise InputError(f"{index_path}: not a valid safetensors index (no weight_map)") from None
    if not isinstance(weight_map, dict):
        raise InputError(f"{index_path}: weight_map is not an object")
    return weight_map


def _check_index_matches(folder: Path, tensors: dict[str, TensorInfo]) -> None:
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        return
    for name, shard in read_index(index_path).items():
        info = tensors.get(name)
        if info is None or info.shard.name != Path(shard).name:
            raise InputError(f"{index_path}: tensor {name!r} is not in {shard}")


def broken_link(path: Path) -> str | None:
    """The words `a broken symbolic link to TARGET` when `path` is a link whose target is gone
    (an interrupted hub download leaves them in a cache snapshot), else None: such a file
    deserves an error of its own, where `is_file()` and "missing" would hide what happened."""
    if path.is_symlink() and not path.exists():
        return f"a broken symbolic link to {os.readlink(path)}"
    return None


def absent_shard(path: Path) -> str:
    """What is wrong with a shard that the index lists and the folder does not hold."""
    return f"listed in {INDEX_FILE} but {broken_link(path) or 'missing'}"


def _read_failure(path: Path, exc: OSError) -> str:
    return broken_link(path) or f"cannot read ({exc.strerror})"


def read_safetensors_header(path: Path) -> dict[str, HeaderEntry]:
    """Parse and check one safetensors header: name -> its entry.

    Catches truncated and corrupt files up front: a header length beyond the file, a header that is
    not JSON, and tensor offsets outside the data section or disagreeing with dtype x shape.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise InputError(f"{path}: truncated safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise InputError(
                    f"{path}: corrupt safetensors file "
                    f"(header length {header_len} exceeds file size {size})"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise InputError(f"{path}: {_read_failure(path, exc)}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InputError(f"{path}: corrupt safetensors file (header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors file (header is not an object)")
    data_start = 8 + header_len
    entries: dict[str, HeaderEntry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _check_entry(path, name, entry, data_start, size - data_start)
    return entries


def _check_entry(path: Path, name: str, entry: Any, data_start: int, data_size: int) -> HeaderEntry:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{path}: corrupt header entry for tensor {name!r}") from None
    numel = 1
    for dim in shape:
        numel *= int(dim)
    width = DTYPE_BYTES.get(dtype)
    if width is None:
        raise InputError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not 0 <= begin <= end <= data_size or end - begin != numel * width:
        raise InputError(
            f"{path}: tensor {name!r} has offsets [{begin}, {end}) outside the "
            f"{data_size}-byte data section or not matching {dtype}{list(shape)}",
            hint="the file is truncated or corrupt; re-download or re-convert it",
        )
    return HeaderEntry(dtype, shape, data_start + begin, end - begin)


@contextmanager
def mapped_safetensors(path: Path) -> Iterator[Callable[[HeaderEntry], torch.Tensor]]:
    """Read tensors of one safetensors file in place, as `safe_open` does: yields a function from
    a checked header entry (`read_safetensors_header`) to a tensor viewing a private mapping of
    the file (copy-on-write: a write never reaches the file).

    The mapping is released on exit by `mmap.close`, which unmaps with the GIL released. A
    `safe_open` mapping is released by torch freeing its storage, holding the GIL: in a
    two-thread fallback scan the other thread then waited (about 10% of the scan's time)."""
    with path.open("rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        yield lambda entry: _mapped_tensor(mapping, entry)
    finally:
        # a tensor that outlives the block (say, in a traceback) unmaps when it is freed
        with suppress(BufferError):
            mapping.close()


def _mapped_tensor(mapping: mmap.mmap, entry: HeaderEntry) -> torch.Tensor:
    import numpy
    import torch

    data = numpy.frombuffer(mapping, numpy.uint8, count=entry.nbytes, offset=entry.start)
    return torch.from_numpy(data).view(torch_dtype(entry.dtype)).reshape(entry.shape)
