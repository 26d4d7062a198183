"""The work of a model-free conversion as one stream of tensors, in output order.

Every stored tensor of the output shards to write comes out of `ConversionStream.results` in
order, as the tensors to write for it: a planned weight quantized on a pool of threads (a
fused set as one, from its first member), any other tensor as where it lies in its file (the
writer copies it file to file). Weights keep quantizing ahead of the one handed out, across
shard boundaries, up to AHEAD_BYTES of source, so the pool stays busy while the caller copies a
big stored tensor (an embedding, an LM head) or finishes a file. A source file stays mapped
until its last tensor has been handed out.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import torch

from llmq.io.checkpoint import HeaderEntry, mapped_safetensors, read_safetensors_header, torch_dtype
from llmq.io.readahead import FileRange, ReadAhead
from llmq.io.stream import FileBytes
from llmq.pack.format import PackFormat, compress
from llmq.pipeline.linears import check_finite
from llmq.pipeline.model_free_plan import ModelFreePlan
from llmq.pipeline.plan import LinearPlan
from llmq.quant.methods import Method
from llmq.quant.primitives import FLOAT32_EXACT, ROW_STRATEGIES, QuantizedWeight

# The float64 working copy of a chunk of rows quantized at once (per-row scales): L2-sized.
CHUNK_BYTES = 2 << 20

# Source bytes of the weights quantized ahead of the one handed out: enough to keep the pool
# busy while the caller copies a big stored tensor (an embedding: 1 GB), a few tensors' memory.
AHEAD_BYTES = 1 << 30
# Source bytes the kernel is asked to read beyond the weight being submitted (page cache).
READ_AHEAD_BYTES = 2 << 30

Tensors = dict[str, torch.Tensor]
Written = dict[str, torch.Tensor | FileBytes]  # a stored tensor is copied from its file


@dataclass
class ConversionStream:
    """The output shards `todo` of `work`, tensor by tensor (`results`)."""

    work: ModelFreePlan
    todo: list[int]
    method: Method
    fmt: PackFormat
    planned: dict[str, LinearPlan] = field(init=False)

    def __post_init__(self) -> None:
        self.planned = {f"{linear.name}.weight": linear for linear in self.work.plan.linears}

    def results(self, pool: ThreadPoolExecutor, ahead: ReadAhead) -> Iterator[tuple[int, Written]]:  # fmt: skip
        """(output shard, tensors to write) for each stored tensor in order (a fused set's
        for its first member), quantizing ahead on the pool until the weights waiting to be
        handed out hold AHEAD_BYTES of source, the kernel reading READ_AHEAD_BYTES beyond the
        last one submitted."""
        items = [(index, names) for index in self.todo for names in self._items(index)]
        names = [name for _, item in items for name in item]
        files = {self.work.tensors[name].shard for name in names}
        headers = {path: read_safetensors_header(path) for path in sorted(files)}
        advice = _Advice(ahead, [self._ranges(item, headers) for _, item in items])
        with _Reader(self.work, names, headers) as read:
            pending: deque[tuple[int, list[str], Future[Tensors] | None]] = deque()
            quantizing = 0
            for position, (index, names) in enumerate(items):
                advice.through(position)
                job = self._job(names, read, pool)
                pending.append((index, names, job))
                quantizing += self._source_bytes(names, job)
                while pending and (quantizing >= AHEAD_BYTES or _finished(pending[0][2])):
                    quantizing -= self._source_bytes(pending[0][1], pending[0][2])
                    yield _handed_out(pending.popleft(), read)
            while pending:
                yield _handed_out(pending.popleft(), read)

    def _ranges(self, names: list[str], headers: dict[Path, dict[str, HeaderEntry]]) -> list[FileRange]:  # fmt: skip
        """Where the stored tensors `names` lie in the source files."""
        entries = [(self.work.tensors[name].shard, name) for name in names]
        return [(path, headers[path][name].start, headers[path][name].nbytes) for path, name in entries]  # fmt: skip

    def _source_bytes(self, names: list[str], job: Future[Tensors] | None) -> int:
        if job is None:
            return 0
        infos = [self.work.tensors[name] for name in names]
        return sum(math.prod(info.shape) * torch_dtype(info.dtype).itemsize for info in infos)

    def _items(self, index: int) -> Iterator[list[str]]:
        """Output shard `index`'s stored tensors, a fused set's members as one item."""
        for name in self.work.shards[index]:
            members = self.work.fused.get(name, [name])
            if members[0] == name:
                yield members

    def _job(self, names: list[str], read: _Reader, pool: ThreadPoolExecutor) -> Future[Tensors] | None:  # fmt: skip
        """The quantization of the planned weights `names` (one, or a fused set) submitted to
        the pool; None for a tensor written as stored."""
        if names[0] not in self.planned:
            return None
        linears = [self.planned[name] for name in names]
        stored = [read(name) for name in names]
        return pool.submit(_quantized, self.method, self.fmt, linears, stored)


def _handed_out(
    item: tuple[int, list[str], Future[Tensors] | None], read: _Reader
) -> tuple[int, Written]:
    index, names, job = item
    tensors: Written = {names[0]: read.stored(names[0])} if job is None else job.result()
    read.done_with(names)
    return index, tensors


def _finished(job: Future[Tensors] | None) -> bool:
    """A quantized weight ready to write. A stored tensor waits until the pool has its fill of
    work, so that the caller copies it (an embedding: 1 GB) while the pool computes."""
    return job is not None and job.done()


class _Advice:
    """Read-ahead advice for the items' ranges, issued up to READ_AHEAD_BYTES of source beyond
    the item being submitted (the page cache, not the process, holds what is read)."""

    def __init__(self, ahead: ReadAhead, ranges: list[list[FileRange]]) -> None:
        self._ahead, self._ranges = ahead, ranges
        sizes = [sum(length for _, _, length in item) for item in ranges]
        self._starts = list(accumulate(sizes, initial=0))
        self._next = 0  # the first item not yet advised

    def through(self, position: int) -> None:
        limit = self._starts[position] + READ_AHEAD_BYTES
        batch: list[FileRange] = []
        while self._next < len(self._ranges) and self._starts[self._next] < limit:
            batch += self._ranges[self._next]
            self._next += 1
        self._ahead.advise(batch)


class _Reader:
    """Stored tensors by name: views of their files' mappings (each file mapped at its first
    such view and released once its last tensor among `names` has been handed out), or where
    they lie in their files, to be copied as they are."""

    def __init__(
        self, work: ModelFreePlan, names: list[str], headers: dict[Path, dict[str, HeaderEntry]]
    ) -> None:
        self._work, self._headers = work, headers
        self._left = Counter(work.tensors[name].shard for name in names)
        self._mapped: dict[Path, tuple[ExitStack, Callable[[HeaderEntry], torch.Tensor]]] = {}

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for mapping, _ in self._mapped.values():
            mapping.close()
        self._mapped.clear()

    def __call__(self, name: str) -> torch.Tensor:
        path = self._work.tensors[name].shard
        if path not in self._mapped:
            mapping = ExitStack()
            self._mapped[path] = mapping, mapping.enter_context(mapped_safetensors(path))
        return self._mapped[path][1](self.stored(name).entry)

    def stored(self, name: str) -> FileBytes:
        path = self._work.tensors[name].shard
        return FileBytes(path, self._headers[path][name])

    def done_with(self, names: list[str]) -> None:
        for name in names:
            path = self._work.tensors[name].shard
            self._left[path] -= 1
            if not self._left[path] and path in self._mapped:
                self._mapped.pop(path)[0].close()


def _quantized(
    method: Method, fmt: PackFormat, linears: list[LinearPlan], stored: list[torch.Tensor]
) -> Tensors:
    """The on-disk tensors of one weight, or of a fused set (NVFP4: one global scale for the
    set), as the layer pipeline computes them: the same values as the layer stream's float32
    weights, the same method call (a set's weights stacked by rows, then split) and packing.
    Weights with per-row scales go through in chunks of rows whose float64 working copies stay
    in the CPU's cache (2.5x faster than the whole weight at once here; rows are independent,
    so the bytes are the same)."""
    args, scale_dtype = linears[0].args, torch_dtype(linears[0].dtype)
    assert args is not None
    if args.strategy in ROW_STRATEGIES:
        weights = []
        for linear, weight in zip(linears, stored, strict=True):
            step = max(1, CHUNK_BYTES // (8 * linear.in_features))
            parts = []
            for start in range(0, len(weight), step):  # each chunk read just before it is quantized
                chunk = _method_input(linear, weight[start : start + step])
                parts.append(method.quantize_weight(chunk, args, None, scale_dtype=scale_dtype).weight)  # fmt: skip
            weights.append(parts[0] if len(parts) == 1 else QuantizedWeight.joined_rows(parts))  # type: ignore[arg-type]
    else:  # a scale spans rows (the tensor's, a block's, a set's global scale): all at once
        floats = [_method_input(*pair) for pair in zip(linears, stored, strict=True)]
        stacked = floats[0] if len(floats) == 1 else torch.cat(floats)
        result = method.quantize_weight(stacked, args, None, scale_dtype=scale_dtype)
        parts = [result] if len(floats) == 1 else result.split_rows([len(w) for w in floats])
        weights = [part.weight for part in parts]
    return {
        f"{linear.name}.{suffix}": tensor
        for linear, weight in zip(linears, weights, strict=True)
        for suffix, tensor in compress(weight, fmt).items()
    }


def _method_input(linear: LinearPlan, rows: torch.Tensor) -> torch.Tensor:
    """`rows` as the method should see them: a bfloat16 or float16 chunk as it is (ranges and
    quotients are computed in float32 or wider, so its float32 copy would change no byte and
    cost a third of the quantization's time), any other dtype made float32 as the layer
    stream makes it."""
    weight = rows if rows.dtype in FLOAT32_EXACT else rows.to(torch.float32)
    check_finite(weight, f"the weights of {linear.name}")
    return weight
