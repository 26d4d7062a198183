"""What a scan simulates and what it judges by: `ScanOptions`, the scheme names a scan accepts
(`scan_args`: a per-tensor check of SCAN_SCHEMES or any `quantize` preset) with their default
NRMSE thresholds, and the checks that turn bad options into an InputError before any file is
read (`check_options`, `compile_filter`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmq.config import (
    SCAN_RATIO_THRESHOLD,
    SCAN_SCHEME,
    SCAN_SHARE_THRESHOLD,
    QuantArgs,
    get_scheme,
)
from llmq.errors import InputError

if TYPE_CHECKING:
    import torch

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
    """The NRMSE flagged by default: FP4 codes (NVFP4, MXFP4) lose about what int4 groups do
    (0.09-0.10 on a Gaussian tensor), so they take int4's threshold."""
    eight_bit_float = args.type == "float" and args.num_bits == 8
    return _DEFAULT_NRMSE["fp8" if eight_bit_float else f"int{args.num_bits}"]


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


def check_options(options: ScanOptions, nrmse_threshold: float) -> None:
    if not nrmse_threshold > 0:
        raise InputError(f"--nrmse-threshold {nrmse_threshold}: must be > 0")
    if not 0 < options.share_threshold <= 1:
        raise InputError(f"--error-share-threshold {options.share_threshold}: must be in (0, 1]")
    if options.ratio_threshold is not None and not options.ratio_threshold > 0:
        raise InputError(f"--ratio-threshold {options.ratio_threshold}: must be > 0")
    if not 1 <= options.workers <= 256:
        raise InputError(f"--jobs {options.workers}: must be between 1 and 256")
    if options.sample is not None and options.sample < 1:
        raise InputError(f"--sample {options.sample}: must be >= 1")


def compile_filter(pattern: str | None, option: str) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InputError(f"{option} {pattern!r}: invalid regular expression ({exc})") from None
