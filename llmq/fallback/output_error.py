"""Scoring linears by their share of the estimated output error, given calibration statistics.

With `ScanOptions.input_weights` (per linear, E[x_j^2] of each input channel on calibration
data), a linear's `<module>.weight` is scanned with its module's input weights
(`input_weights_for`), so that its statistics carry the estimated output error
sum_j ||dW_:j||^2 E[x_j^2] (`llmq.fallback.quant_error`). `share_output_error` then sets each
such linear's share of the summed output error, which the scan flags by in place of its NRMSE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from llmq.fallback.inventory import Job
    from llmq.fallback.options import ScanOptions
    from llmq.fallback.report import TensorScan


def input_weights_for(job: Job, options: ScanOptions) -> torch.Tensor | None:
    if options.input_weights is None or not job.name.endswith(".weight"):
        return None
    return options.input_weights.get(job.name.removesuffix(".weight"))


def share_output_error(scans: list[TensorScan]) -> bool:
    """Set each calibrated linear's share of the summed output error; False if none has one."""
    errors = [s.stats.output_error for s in scans if s.stats.output_error is not None]
    total = sum(errors)
    for scan in scans:
        if scan.stats.output_error is not None:
            scan.error_share = scan.stats.output_error / total if total else 0.0
    return bool(errors)
