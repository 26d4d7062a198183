"""`fallback_scan`: which tensors will not survive quantization."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.config import (
    SCAN_RATIO_THRESHOLD,
    SCAN_SCHEME,
    SCAN_SHARE_THRESHOLD,
)
from llmq.models import BUILTIN_MODELS, resolve_model
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:
    from llmq.fallback.report import ScanReport


def fallback_scan(
    path: str | Path,
    *,
    scheme: str = SCAN_SCHEME,
    group_size: int | None = None,
    nrmse_threshold: float | None = None,
    ratio_threshold: float | None = SCAN_RATIO_THRESHOLD,
    include: str | None = None,
    exclude: str | None = None,
    workers: int = 1,
    sample: int | None = None,
    calib_stats: str | Path | None = None,
    error_share_threshold: float = SCAN_SHARE_THRESHOLD,
    progress: Progress = NO_PROGRESS,
) -> ScanReport:
    """Scan every .safetensors file under PATH (a folder, a file or a built-in model name) for
    tensors that will not survive quantization under `scheme` (its group size overridden by
    `group_size`, -1 per-channel, as in `quantize`); returns a `ScanReport`.

    Flags a tensor whose NRMSE ||W - deq(q(W))|| / ||W|| exceeds `nrmse_threshold` (None: the
    scheme's default), whose spread ratio (max - min) / (Q3 - Q1) exceeds `ratio_threshold`
    (None: not used), or that holds NaN/Inf. Statistics are exact unless `sample` (values per
    tensor) is given. Needs no model class, no calibration data and no GPU. Given `calib_stats`
    (from `calibrate`), each linear's output error is estimated as sum_j ||dW_:j||^2 E[x_j^2]
    (E[x_j^2] from the Hessian's diagonal, or mean|x_j|^2 without one), and linears are flagged
    when their share of the total exceeds `error_share_threshold`."""
    from llmq.config import with_group_size
    from llmq.fallback.options import ScanOptions, scan_args
    from llmq.fallback.scan import fallback_scan as scan

    args = with_group_size(scan_args(scheme), group_size) if group_size is not None else None
    root = Path(path)
    if not root.exists() and str(path) in BUILTIN_MODELS:
        root = resolve_model(str(path), progress=progress)
    options = ScanOptions(
        scheme=scheme, args=args, nrmse_threshold=nrmse_threshold, ratio_threshold=ratio_threshold,
        include=include, exclude=exclude, workers=workers, sample=sample,
        input_weights=_input_weights(Path(calib_stats)) if calib_stats else None,
        share_threshold=error_share_threshold,
    )  # fmt: skip
    report = scan(root, options, progress=progress)
    report.calib_stats = None if calib_stats is None else str(calib_stats)
    return report


def _input_weights(path: Path) -> dict[str, Any]:
    from llmq.calib.stats import CalibStats

    return CalibStats.load(path).input_weights()
