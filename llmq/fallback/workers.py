"""The thread pool that reads and reduces an inventory's tensors.

Jobs are grouped by file into batches (`_BATCH_BYTES`), largest first so that workers finish
together; each batch maps its file once (`mapped_safetensors`) and computes its tensors'
statistics together (`llmq.fallback.stats.batch_stats`), so a worker holds one big tensor's
pages (or 16 MB of small ones) plus a few MB. A tensor that cannot be read is recorded against
its file, and the others are still scanned. Workers are threads: the compiled passes and torch
release the GIL, and threads share the page cache and start instantly; each worker's torch ops
use its share of the cores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING

from llmq.config import QuantArgs
from llmq.fallback.inventory import Inventory, Job, reading_order
from llmq.fallback.options import ScanOptions
from llmq.fallback.output_error import input_weights_for
from llmq.fallback.report import TensorScan
from llmq.io.checkpoint import HeaderEntry, mapped_safetensors
from llmq.progress import Progress

if TYPE_CHECKING:
    import torch

    from llmq.fallback.summary import TensorStats

_BATCH_BYTES = 16 << 20
"""Small tensors of one file are scanned through one open handle: opening a file costs ~0.4 ms,
a few percent of scanning 16 MB. The handle's mapped pages are released when it closes, so a
worker holds one big tensor or at most 16 MB of small ones."""
_READ_ERRORS = (OSError, RuntimeError, ValueError)


def scan_inventory(
    inventory: Inventory, args: QuantArgs, options: ScanOptions, progress: Progress
) -> list[TensorScan]:
    """Each job's scan in reading order; a job that cannot be read goes to `inventory.failed`."""
    from llmq.cpu import threads_per_worker
    from llmq.heap import reused_heap

    scans: list[TensorScan] = []
    total = sum(job.nbytes for job in inventory.jobs)
    with (
        progress.stage(f"scanning {len(inventory.jobs)} tensors (bytes)", total=total) as advance,
        threads_per_worker(options.workers),
        reused_heap(),
        ThreadPoolExecutor(max_workers=options.workers) as pool,
    ):
        batches = _batches(inventory.jobs)
        futures = {pool.submit(_scan_batch, batch, args, options): batch for batch in batches}
        for future in as_completed(futures):
            for job, outcome in future.result():
                if isinstance(outcome, TensorScan):
                    scans.append(outcome)
                else:
                    inventory.failed.setdefault(job.relative, f"cannot read {job.name}: {outcome}")
            advance(sum(job.nbytes for job in futures[future]))
    scans.sort(key=lambda s: reading_order(s.file, s.name))
    return scans


def _batches(jobs: list[Job]) -> list[list[Job]]:
    """`jobs` (largest first) grouped by file into batches of at most _BATCH_BYTES (a larger
    tensor alone), largest batch first so that workers finish together."""
    batches: list[tuple[list[Job], int]] = []
    filling: dict[Path, int] = {}  # file -> index of its batch still being filled
    for job in jobs:
        at = filling.get(job.file)
        if at is None or batches[at][1] + job.nbytes > _BATCH_BYTES:
            at = filling[job.file] = len(batches)
            batches.append(([], 0))
        members, size = batches[at]
        members.append(job)
        batches[at] = (members, size + job.nbytes)
    return [members for members, _ in sorted(batches, key=lambda batch: -batch[1])]


def _scan_batch(
    batch: list[Job], args: QuantArgs, options: ScanOptions
) -> list[tuple[Job, TensorScan | Exception]]:
    """Each job's scan, or the error that stopped it (one file: mapped once; the statistics of
    the tensors read are computed together, see `batch_stats`)."""
    try:
        with mapped_safetensors(batch[0].file) as read:
            return _scan_mapped(batch, read, args, options)
    except _READ_ERRORS as exc:
        return [(job, exc) for job in batch]


def _scan_mapped(
    batch: list[Job],
    read: Callable[[HeaderEntry], torch.Tensor],
    args: QuantArgs,
    options: ScanOptions,
) -> list[tuple[Job, TensorScan | Exception]]:
    """`_scan_batch` within the mapping; returns no tensor, so that the mapping can close."""
    from llmq.fallback.stats import batch_stats

    outcomes = [(job, _read_or_error(read, job, options)) for job in batch]
    tensors = [(job, tensor) for job, tensor in outcomes if not isinstance(tensor, Exception)]
    stats = batch_stats(
        [tensor for _, tensor in tensors],
        args,
        input_weights=[input_weights_for(job, options) for job, _ in tensors],
    )
    scans = iter(_scan(job, tensor, s) for (job, tensor), s in zip(tensors, stats, strict=True))
    return [
        (job, outcome if isinstance(outcome, Exception) else next(scans))
        for job, outcome in outcomes
    ]


def _read_or_error(
    read: Callable[[HeaderEntry], torch.Tensor], job: Job, options: ScanOptions
) -> torch.Tensor | Exception:
    """The tensor to scan (rows sampled if asked), or the error that stopped its reading."""
    try:
        tensor = read(job.entry)
    except _READ_ERRORS as exc:
        return exc
    if job.transposed:
        tensor = tensor.transpose(-1, -2)
    if options.sample is not None and tensor.numel() > options.sample:
        tensor = sample_rows(tensor, options.sample, seed=job.name)
    return tensor


def _scan(job: Job, tensor: torch.Tensor, stats: TensorStats) -> TensorScan:
    sampled = tensor.numel() < math.prod(job.entry.shape)
    return TensorScan(
        job.name, job.relative, job.entry.dtype, list(job.entry.shape), stats, sampled
    )


def sample_rows(tensor: torch.Tensor, sample: int, *, seed: str) -> torch.Tensor:
    """About `sample` values of `tensor`: whole rows (all dims but the last) chosen at random
    but reproducibly, so that per-channel and per-group scales keep their meaning."""
    import zlib

    import torch

    rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.ndim > 1 else tensor.reshape(-1, 1)
    keep = max(1, math.ceil(sample / rows.shape[1]))
    generator = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    chosen = torch.randperm(rows.shape[0], generator=generator)[:keep].sort().values
    picked = rows.index_select(0, chosen)
    return picked if tensor.ndim > 1 else picked.reshape(-1)
