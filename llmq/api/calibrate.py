"""`calibrate`: per-linear input statistics saved for later runs."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmq.api.common import (
    _open,
)
from llmq.config import DEFAULT_CALIB_SAMPLES, CalibConfig, build
from llmq.errors import InputError
from llmq.progress import NO_PROGRESS, Progress
from llmq.texts import DEFAULT_CALIBRATION_TEXT, text_inputs


@dataclass(slots=True)
class CalibrateResult:
    out: Path
    model: str
    linears: int
    hessian: bool
    calibration: dict[str, Any]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out": str(self.out)}


def calibrate(
    model: str | Path,
    out: str | Path,
    *,
    calib_text: str = DEFAULT_CALIBRATION_TEXT,
    num_samples: int = DEFAULT_CALIB_SAMPLES,
    seq_len: int = 512,
    seed: int = 0,
    hessian: bool = False,
    overwrite: bool = False,
    space_check: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> CalibrateResult:
    """Collect per-linear input statistics (absmax, mean |x|, optionally XᵀX) into a
    .safetensors file that `quantize(calib_stats=...)` reuses. One run at a time writes OUT;
    `space_check=False` skips the refusal of a file that will not fit."""
    from llmq.calib.collect import collect_stats
    from llmq.calib.stats import check_stats_output, saved_stats_bytes
    from llmq.calib.windows import model_windows
    from llmq.io.atomic import check_free_space, claim_output

    started = time.perf_counter()
    cal = build(CalibConfig, text=calib_text, num_samples=num_samples, seq_len=seq_len, seed=seed)
    assert isinstance(cal, CalibConfig)
    out = Path(out)
    if out.suffix != ".safetensors":
        raise InputError(
            f"{out}: statistics are written as .safetensors", hint=f"use {out.stem}.safetensors"
        )
    ckpt = _open(model, progress)
    inputs = [("model", ckpt.path), *text_inputs(calib_text, "calibration text")]
    with claim_output(out, inputs=inputs):  # held until the file is written
        check_stats_output(out, overwrite=overwrite)
        if space_check:
            check_free_space(out, saved_stats_bytes(ckpt, hessian=hessian))
        windows = model_windows(ckpt.path, cal, progress)
        stats = collect_stats(
            ckpt, windows.input_ids, hessian=hessian, progress=progress, device=device
        )
        stats.metadata = {
            "model": str(model),
            **cal.model_dump(),
            "tokens": windows.num_tokens,
            "hessian": hessian,
        }
        stats.save(out)
    return CalibrateResult(
        out=out,
        model=str(model),
        linears=len(stats.inputs),
        hessian=hessian,
        calibration=stats.metadata,
        seconds=time.perf_counter() - started,
    )
