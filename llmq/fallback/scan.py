"""`fallback-scan`: every weight tensor of every .safetensors file under a folder, scored for how
badly it survives quantization, with no model class, no calibration data and no GPU.

`fallback_scan` runs the stages in order: the options checked (`llmq.fallback.options`), the
tensors listed from the headers alone (`llmq.fallback.inventory`), then read in place from the
memory-mapped files and reduced by compiled passes in cache-sized blocks, by a pool of threads
(`llmq.fallback.workers`, statistics from `llmq.fallback.stats`); with calibration statistics,
linears are scored by their share of the output error (`llmq.fallback.output_error`). This
module decides which tensors are flagged, and why.
"""

from __future__ import annotations

import time
from pathlib import Path

from llmq.fallback.inventory import take_inventory
from llmq.fallback.options import (
    ScanOptions,
    check_options,
    compile_filter,
    default_nrmse_threshold,
    scan_args,
)
from llmq.fallback.output_error import share_output_error
from llmq.fallback.report import ScanReport, TensorScan
from llmq.fallback.workers import scan_inventory
from llmq.progress import NO_PROGRESS, Progress

_DEFAULT_OPTIONS = ScanOptions()  # frozen: one shared default, as a default argument would be


def fallback_scan(
    path: str | Path, options: ScanOptions = _DEFAULT_OPTIONS, *, progress: Progress = NO_PROGRESS
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
    check_options(options, nrmse_threshold)
    include, exclude = (compile_filter(p, o) for p, o in ((options.include, "--include"), (options.exclude, "--exclude")))  # fmt: skip
    inventory = take_inventory(root, include, exclude)
    # torch and the compiled passes load before the clock starts: ~3 s that `seconds` (and
    # the throughput the CLI prints) would otherwise count as scanning
    from llmq.fallback.stats import load_passes

    load_passes()

    started = time.perf_counter()
    scans = scan_inventory(inventory, args, options, progress)
    calibrated = share_output_error(scans)
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
