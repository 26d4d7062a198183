"""`fallback-scan`: every weight tensor of every .safetensors file under a folder, scored for how
badly it survives quantization, with no model class, no calibration data and no GPU.

Tensors are read in place from the memory-mapped files (`mapped_safetensors`, headers checked
first) and reduced by compiled passes in cache-sized blocks (`llmq.fallback.stats`), so a worker
holds one big tensor's pages (or 16 MB of small ones) plus a few MB. Workers are threads: the
compiled passes and torch release the GIL, and threads share the page cache and start instantly.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.config import (
    SCAN_RATIO_THRESHOLD,
    SCAN_SCHEME,
    SCAN_SHARE_THRESHOLD,
    QuantArgs,
    get_scheme,
)
from llmq.errors import InputError
from llmq.fallback.report import ScanReport, Skipped, TensorScan
from llmq.io.checkpoint import (
    INDEX_FILE,
    HeaderEntry,
    absent_shard,
    broken_link,
    mapped_safetensors,
    read_index,
    read_safetensors_header,
)
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:
    import torch

    from llmq.fallback.stats import TensorStats

SCAN_SCHEMES: dict[str, QuantArgs] = {
    "int8-tensor": QuantArgs(num_bits=8, strategy="tensor"),
    "fp8-tensor": QuantArgs(num_bits=8, type="float", strategy="tensor"),
}
"""Per-tensor checks beyond the presets; any `quantize` preset name (w4a16, w8a8, fp8, ...)
is also accepted and scans with its weight arguments."""

# NRMSE of a Gaussian tensor (4096 x 4096) under each kind of scheme is about 0.012 for int8
# per-tensor, 0.006 int8 per-channel, 0.11 int4 g128, 0.02 fp8: the defaults flag tensors
# several times worse than that.
_DEFAULT_NRMSE = {"int8": 0.05, "int4": 0.2, "fp8": 0.06}

_READABLE = {"BF16", "F16", "F32", "F8_E4M3", "F8_E5M2"}


def scan_args(scheme: str) -> QuantArgs:
    """The weight arguments a scan simulates for `scheme` (a scan name or a preset)."""
    if scheme.lower() in SCAN_SCHEMES:
        return SCAN_SCHEMES[scheme.lower()]
    try:
        return get_scheme(scheme).weights
    except InputError as exc:
        raise InputError(
            f"unknown scheme {scheme!r}",
            hint=f"choose one of: {', '.join(SCAN_SCHEMES)}, or a quantize preset ({exc.hint})",
        ) from None


def default_nrmse_threshold(args: QuantArgs) -> float:
    return _DEFAULT_NRMSE["fp8" if args.type == "float" else f"int{args.num_bits}"]


@dataclass(frozen=True, slots=True)
class ScanOptions:
    scheme: str = SCAN_SCHEME
    args: QuantArgs | None = None  # simulate these weight arguments (named `scheme`) instead
    nrmse_threshold: float | None = None  # None: the scheme's default
    ratio_threshold: float | None = SCAN_RATIO_THRESHOLD  # None: not used
    share_threshold: float = SCAN_SHARE_THRESHOLD  # used with input_weights only
    include: str | None = None  # regex searched in tensor names
    exclude: str | None = None
    workers: int = 1
    sample: int | None = None  # elements per tensor; None: exact, every value
    # module name -> per-input-channel weights (E[x_j^2] on calibration data): linears are then
    # scored by their share of the estimated output error
    input_weights: Mapping[str, torch.Tensor] | None = None


@dataclass(slots=True)
class _Job:
    name: str
    file: Path
    relative: str  # the file's path under the scanned folder, as reported
    entry: HeaderEntry

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


@dataclass(slots=True)
class _Inventory:
    jobs: list[_Job] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # file -> one-line error


def fallback_scan(
    path: str | Path, options: ScanOptions = ScanOptions(), *, progress: Progress = NO_PROGRESS
) -> ScanReport:
    """Scan every .safetensors file under `path` (a folder, searched recursively, or one file).

    Raises InputError for a missing path, bad options, no .safetensors at all, or --include /
    --exclude leaving no tensor; files that cannot be read are listed in `report.failed` and
    the others are still scanned."""
    root = Path(path)
    args = options.args or scan_args(options.scheme)
    nrmse_threshold = options.nrmse_threshold
    if nrmse_threshold is None:
        nrmse_threshold = default_nrmse_threshold(args)
    _check_options(options, nrmse_threshold)
    include, exclude = (_regex(p, o) for p, o in ((options.include, "--include"), (options.exclude, "--exclude")))  # fmt: skip
    inventory = _inventory(root, include, exclude)
    # torch and the compiled passes load before the clock starts: ~3 s that `seconds` (and
    # the throughput the CLI prints) would otherwise count as scanning
    from llmq.fallback.stats import load_passes

    load_passes()

    started = time.perf_counter()
    scans = _run(inventory, args, options, progress)
    calibrated = _share_output_error(scans)
    share_threshold = options.share_threshold if calibrated else None
    return ScanReport(
        root=str(root),
        scheme=options.scheme,
        args=args,
        nrmse_threshold=nrmse_threshold,
        ratio_threshold=options.ratio_threshold,
        share_threshold=share_threshold,
        sample=options.sample,
        tensors=[
            _flag(s, nrmse_threshold, share_threshold, options.ratio_threshold) for s in scans
        ],
        skipped=inventory.skipped,
        failed=inventory.failed,
        seconds=time.perf_counter() - started,
        workers=options.workers,
    )


def _share_output_error(scans: list[TensorScan]) -> bool:
    """Set each calibrated linear's share of the summed output error; False if none has one."""
    errors = [s.stats.output_error for s in scans if s.stats.output_error is not None]
    total = sum(errors)
    for scan in scans:
        if scan.stats.output_error is not None:
            scan.error_share = scan.stats.output_error / total if total else 0.0
    return bool(errors)


def _check_options(options: ScanOptions, nrmse_threshold: float) -> None:
    if not nrmse_threshold > 0:
        raise InputError(f"--nrmse-threshold {nrmse_threshold}: must be > 0")
    if not 0 < options.share_threshold <= 1:
        raise InputError(f"--error-share-threshold {options.share_threshold}: must be in (0, 1]")
    if options.ratio_threshold is not None and not options.ratio_threshold > 0:
        raise InputError(f"--ratio-threshold {options.ratio_threshold}: must be > 0")
    if not 1 <= options.workers <= 256:
        raise InputError(f"--workers {options.workers}: must be between 1 and 256")
    if options.sample is not None and options.sample < 1:
        raise InputError(f"--sample {options.sample}: must be >= 1")


def _regex(pattern: str | None, option: str) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InputError(f"{option} {pattern!r}: invalid regular expression ({exc})") from None


def safetensors_files(root: Path) -> list[Path]:
    """The .safetensors files under `root` (or `root` itself), InputError when there are none."""
    if not root.exists():
        raise InputError(f"{root}: no such file or folder")
    if root.is_file():
        if root.suffix != ".safetensors":
            raise InputError(f"{root}: not a .safetensors file")
        return [root]
    files = sorted(p for p in root.rglob("*.safetensors") if p.is_file() or broken_link(p))
    if not files:
        raise InputError(
            f"{root}: no .safetensors files in this folder or below",
            hint="fallback-scan reads safetensors checkpoints only",
        )
    return files


def _inventory(
    root: Path, include: re.Pattern[str] | None, exclude: re.Pattern[str] | None
) -> _Inventory:
    """Every tensor to scan, from the headers alone; unreadable files are recorded, not fatal."""
    inventory = _Inventory()
    base = root if root.is_dir() else root.parent
    for index in sorted(base.rglob(INDEX_FILE)) if root.is_dir() else []:
        _check_index(index, base, inventory)
    names: list[str] = []  # every tensor of the readable files, to check the filters
    for file in safetensors_files(root):
        try:
            header = read_safetensors_header(file)
        except InputError as exc:
            inventory.failed[_relative(file, base)] = exc.message.removeprefix(f"{file}: ")
            continue
        names.extend(header)
        for name, entry in header.items():
            if (include and not include.search(name)) or (exclude and exclude.search(name)):
                continue
            reason = _skip_reason(entry.dtype, entry.shape)
            relative = _relative(file, base)
            if reason:
                inventory.skipped.append(
                    Skipped(name, relative, entry.dtype, list(entry.shape), reason)
                )
            else:
                inventory.jobs.append(_Job(name, file, relative, entry))
    _check_filters_matched(names, inventory, include, exclude)
    inventory.jobs.sort(key=lambda job: -job.nbytes)  # largest first: workers finish together
    inventory.skipped.sort(key=lambda s: reading_order(s.file, s.name))
    return inventory


def _check_filters_matched(
    names: list[str],
    inventory: _Inventory,
    include: re.Pattern[str] | None,
    exclude: re.Pattern[str] | None,
) -> None:
    """A filter that leaves no tensor is a mistake (a typo, a wrong naming scheme), not a clean
    scan: `--fail-on-flagged` would pass a CI gate that looked at nothing."""
    if not names or inventory.jobs or inventory.skipped:
        return
    given = [f"{option} {pattern.pattern!r}" for option, pattern in (("--include", include), ("--exclude", exclude)) if pattern]  # fmt: skip
    raise InputError(
        f"{' '.join(given)}: none of the {len(names)} tensors is left to scan",
        hint=f"patterns are regular expressions searched in names such as {min(names, key=reading_order)!r}",
    )


def _check_index(index: Path, base: Path, inventory: _Inventory) -> None:
    try:
        shards = {str(shard) for shard in read_index(index).values()}
    except (InputError, OSError) as exc:
        inventory.failed[_relative(index, base)] = str(exc).removeprefix(f"{index}: ")
        return
    for path in sorted(index.parent / shard for shard in shards):
        if not path.is_file():
            inventory.failed[_relative(path, base)] = absent_shard(path)


def _relative(file: Path, base: Path) -> str:
    try:
        return str(file.relative_to(base))
    except ValueError:
        return str(file)


def _skip_reason(dtype: str, shape: tuple[int, ...]) -> str | None:
    if dtype not in _READABLE:
        if dtype.startswith(("I", "U", "BOOL")):
            return f"integer tensor ({dtype}): packed codes, indices or scales, not a float weight"
        return f"{dtype} is not scanned (bf16, fp16, fp32 and fp8 are)"
    if not shape or math.prod(shape) == 0:
        return "scalar or empty"
    return None


@contextmanager
def _threads_per_worker(workers: int) -> Any:
    """Each worker's torch ops use its share of the cores, so workers do not oversubscribe."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


_BATCH_BYTES = 16 << 20
"""Small tensors of one file are scanned through one open handle: opening a file costs ~0.4 ms,
a few percent of scanning 16 MB. The handle's mapped pages are released when it closes, so a
worker holds one big tensor or at most 16 MB of small ones."""
_READ_ERRORS = (OSError, RuntimeError, ValueError)
_DIGITS = re.compile(r"([0-9]+)")


def _run(
    inventory: _Inventory, args: QuantArgs, options: ScanOptions, progress: Progress
) -> list[TensorScan]:
    from llmq.heap import reused_heap

    scans: list[TensorScan] = []
    total = sum(job.nbytes for job in inventory.jobs)
    with (
        progress.stage(f"scanning {len(inventory.jobs)} tensors (bytes)", total=total) as advance,
        _threads_per_worker(options.workers),
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


def reading_order(*texts: str) -> tuple[list[str | int] | str, ...]:
    """Sort key that reads numbers as numbers: layers.2 before layers.10 (a plain string sort
    lists layers 0, 1, 10, 11, ..., 19, 2, 20, which is hard to scan by eye). Splitting on the
    numbers puts them at the odd places, so parts at the same place compare like with like.
    The texts themselves come last, so that "layer07" and "layer7" still have one order."""
    numbered = (
        [int(part) if place % 2 else part for place, part in enumerate(_DIGITS.split(text))]
        for text in texts
    )
    return (*numbered, *texts)


def _batches(jobs: list[_Job]) -> list[list[_Job]]:
    """`jobs` (largest first) grouped by file into batches of at most _BATCH_BYTES (a larger
    tensor alone), largest batch first so that workers finish together."""
    batches: list[tuple[list[_Job], int]] = []
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
    batch: list[_Job], args: QuantArgs, options: ScanOptions
) -> list[tuple[_Job, TensorScan | Exception]]:
    """Each job's scan, or the error that stopped it (one file: mapped once; the statistics of
    the tensors read are computed together, see `batch_stats`)."""
    try:
        with mapped_safetensors(batch[0].file) as read:
            return _scan_mapped(batch, read, args, options)
    except _READ_ERRORS as exc:
        return [(job, exc) for job in batch]


def _scan_mapped(
    batch: list[_Job],
    read: Callable[[HeaderEntry], torch.Tensor],
    args: QuantArgs,
    options: ScanOptions,
) -> list[tuple[_Job, TensorScan | Exception]]:
    """`_scan_batch` within the mapping; returns no tensor, so that the mapping can close."""
    from llmq.fallback.stats import batch_stats

    outcomes = [(job, _read_or_error(read, job, options)) for job in batch]
    tensors = [(job, tensor) for job, tensor in outcomes if not isinstance(tensor, Exception)]
    stats = batch_stats(
        [tensor for _, tensor in tensors],
        args,
        input_weights=[_input_weights(job, options) for job, _ in tensors],
    )
    scans = iter(_scan(job, tensor, s) for (job, tensor), s in zip(tensors, stats, strict=True))
    return [
        (job, outcome if isinstance(outcome, Exception) else next(scans))
        for job, outcome in outcomes
    ]


def _read_or_error(
    read: Callable[[HeaderEntry], torch.Tensor], job: _Job, options: ScanOptions
) -> torch.Tensor | Exception:
    """The tensor to scan (rows sampled if asked), or the error that stopped its reading."""
    try:
        tensor = read(job.entry)
    except _READ_ERRORS as exc:
        return exc
    if options.sample is not None and tensor.numel() > options.sample:
        tensor = sample_rows(tensor, options.sample, seed=job.name)
    return tensor


def _scan(job: _Job, tensor: torch.Tensor, stats: TensorStats) -> TensorScan:
    sampled = tensor.numel() < math.prod(job.entry.shape)
    return TensorScan(
        job.name, job.relative, job.entry.dtype, list(job.entry.shape), stats, sampled
    )


def _input_weights(job: _Job, options: ScanOptions) -> torch.Tensor | None:
    if options.input_weights is None or not job.name.endswith(".weight"):
        return None
    return options.input_weights.get(job.name.removesuffix(".weight"))


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


def _flag(
    scan: TensorScan,
    nrmse_threshold: float,
    share_threshold: float | None,
    ratio_threshold: float | None,
) -> TensorScan:
    reasons = []
    stats = scan.stats
    if stats.nan or stats.inf:
        reasons.append(f"{stats.nan} NaN, {stats.inf} Inf values")
    if scan.error_share is not None and share_threshold is not None:
        if scan.error_share > share_threshold:
            reasons.append(f"output error share {scan.error_share:.3g} > {share_threshold:g}")
    elif stats.nrmse is not None and stats.nrmse > nrmse_threshold:
        reasons.append(f"nrmse {stats.nrmse:.4g} > {nrmse_threshold:g}")
    if ratio_threshold is not None and stats.spread_ratio > ratio_threshold:
        reasons.append(f"spread ratio {stats.spread_ratio:.4g} > {ratio_threshold:g}")
    scan.reasons = reasons
    return scan
