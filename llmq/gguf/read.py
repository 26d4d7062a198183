"""A GGUF file read back as its source checkpoint's tensors (for `llmq verify`).

A GGUF file is held to the model its tensors define: the source checkpoint's architecture
(config, tensor names, anything the file does not hold) with each tensor the file holds as the
`gguf` package's reference code decodes it, q/k rows put back in Hugging Face's order. So llmq's
evaluator computes what the file means, and each runtime that loads the file (transformers'
GGUF reader) is compared with that. The file names its source (`SOURCE_KEY`, written by
`export_gguf`); `--baseline` names it for a file llmq did not write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from llmq.errors import InputError
from llmq.gguf.export import SOURCE_KEY, named_tensors
from llmq.gguf.mla import K_B, V_B, join_kv_b
from llmq.gguf.model import read_field, unpermute_rotary_rows
from llmq.io.checkpoint import Checkpoint


def is_gguf(path: Path) -> bool:
    """A GGUF file (by its magic bytes)."""
    try:
        with path.open("rb") as file:
            return path.is_file() and file.read(4) == b"GGUF"
    except OSError:
        return False


def recorded_source(path: Path) -> str | None:
    """The checkpoint llmq wrote the file from; None for another tool's file."""
    source = read_field(path, SOURCE_KEY)
    return None if source is None else str(source)


@lru_cache(maxsize=2)
def _tensors(path: Path) -> dict[str, Any]:
    """The file's tensors by name (memory-mapped: read when decoded)."""
    try:
        return {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable GGUF file ({exc})") from None


@dataclass(frozen=True, slots=True)
class DecodedTensor:
    """A source tensor as the GGUF file holds it, decoded by the gguf package."""

    file: Path
    name: str  # the GGUF name
    rotary_heads: int | None
    shape: tuple[int, ...]  # the checkpoint's (a vector GGUF holds 1-D may be [1, n] there)
    expert: int | None = None  # one expert's share of a stacked tensor
    offset: float = 0.0  # what the writer added (Gemma's norms)

    def read(self, stored: Any) -> Tensor:
        tensor = _tensors(self.file)[self.name]
        shape = [int(n) for n in reversed(tensor.shape)]
        data = tensor.data
        if self.expert is not None:
            data, shape = data[self.expert], shape[1:]
        values = gguf.quants.dequantize(data, tensor.tensor_type).reshape(shape)
        if self.rotary_heads is not None:
            values = unpermute_rotary_rows(values, self.rotary_heads)
        if self.offset:
            values = values - np.float32(self.offset)
        copied = np.array(values, dtype=np.float32)  # a copy: the file is mapped read-only
        return torch.from_numpy(copied.reshape(self.shape))


@dataclass(frozen=True, slots=True)
class DecodedLatent:
    """DeepSeek's kv_b_proj joined back from the two shares llama.cpp's layout stores apart."""

    k_b: DecodedTensor
    v_b: DecodedTensor
    shape: tuple[int, ...]

    def read(self, stored: Any) -> Tensor:
        joined = join_kv_b(self.k_b.read(stored).numpy(), self.v_b.read(stored).numpy())
        return torch.from_numpy(np.ascontiguousarray(joined).reshape(self.shape))


def gguf_as_checkpoint(source: Checkpoint, path: Path) -> Checkpoint:
    """`source` with every tensor the GGUF file holds shown as the file decodes it (float32);
    InputError when the file lacks one of the source's tensors or holds another shape."""
    held = _tensors(path)
    shown, views = dict(source.tensors), {}
    shares: dict[str, DecodedTensor] = {}
    for tensor in named_tensors(source):
        if not tensor.sources:  # derived from the config (Llama 3's rotary factors)
            continue
        stored = held.get(tensor.name)
        first = tensor.sources[0]
        if stored is None:
            raise InputError(f"{path}: holds no {tensor.name} ({first} of {source.path})", hint="verify a GGUF file against the checkpoint it was written from (--baseline)")  # fmt: skip
        shape = tuple(int(n) for n in reversed(stored.shape))
        if shape != tensor.shape:
            raise InputError(f"{path}: {tensor.name} is {list(shape)}, {first} of {source.path} is {list(tensor.shape)}")  # fmt: skip
        if tensor.part is not None:  # a share of DeepSeek's kv_b: joined once both are seen
            first_shape = tuple(source.tensors[first].shape)
            shares[tensor.part] = DecodedTensor(path, tensor.name, None, tensor.shape)
            shown[first] = dataclasses.replace(source.tensors[first], dtype="F32")
            if len(shares) == 2:
                views[first] = DecodedLatent(shares.pop(K_B), shares.pop(V_B), first_shape)
            continue
        stacked = len(tensor.sources) > 1
        for expert, name in enumerate(tensor.sources):
            shown[name] = dataclasses.replace(source.tensors[name], dtype="F32")
            shape = tuple(source.tensors[name].shape)
            views[name] = DecodedTensor(path, tensor.name, tensor.rotary_heads, shape, expert if stacked else None, tensor.offset)  # fmt: skip
    return Checkpoint(
        path=source.path, config=source.config, layout=source.layout, tensors=shown, views=views
    )
