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
    imatrix: bool = False,
    overwrite: bool = False,
    space_check: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> CalibrateResult:
    """Collect per-linear input statistics (absmax, mean |x|, optionally XᵀX) into a
    .safetensors file that `quantize(calib_stats=...)` reuses. One run at a time writes OUT;
    `space_check=False` skips the refusal of a file that will not fit. `imatrix`: write the
    mean squared inputs instead, as llama.cpp's importance matrix (a .imatrix GGUF file that
    `quantize(format="gguf", imatrix=...)` and llama.cpp's `llama-quantize --imatrix` read)."""
    from llmq.calib.collect import collect_stats
    from llmq.calib.stats import check_stats_output, saved_stats_bytes
    from llmq.calib.windows import model_windows
    from llmq.io.atomic import claim_output
    from llmq.io.space import check_free_space

    started = time.perf_counter()
    cal = build(CalibConfig, text=calib_text, num_samples=num_samples, seq_len=seq_len, seed=seed)
    assert isinstance(cal, CalibConfig)
    out = Path(out)
    if imatrix:
        return _calibrate_imatrix(model, out, cal, overwrite=overwrite, progress=progress,
                                  device=device, started=started)  # fmt: skip
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


def _calibrate_imatrix(
    model: str | Path,
    out: Path,
    cal: CalibConfig,
    *,
    overwrite: bool,
    progress: Progress,
    device: str | None,
    started: float,
) -> CalibrateResult:
    from llmq.calib.collect import collect_stats
    from llmq.calib.windows import model_windows
    from llmq.gguf.imatrix import check_imatrix_output, imatrix_from_stats, save_imatrix
    from llmq.gguf.model import gguf_arch
    from llmq.io.atomic import claim_output

    if out.suffix not in (".imatrix", ".gguf"):
        raise InputError(f"{out}: an imatrix is a GGUF file", hint=f"use {out.stem}.imatrix")
    ckpt = _open(model, progress)
    gguf_arch(ckpt.config)  # a family GGUF cannot name: refused before the pass
    inputs = [("model", ckpt.path), *text_inputs(cal.text, "calibration text")]
    with claim_output(out, inputs=inputs):
        check_imatrix_output(out, overwrite=overwrite)
        windows = model_windows(ckpt.path, cal, progress)
        stats = collect_stats(ckpt, windows.input_ids, norms=True, progress=progress, device=device)  # fmt: skip
        matrix = imatrix_from_stats(ckpt, stats, cal)
        save_imatrix(out, matrix)
    calibration = {"model": str(model), **cal.model_dump(), "tokens": windows.num_tokens}
    return CalibrateResult(
        out=out, model=str(model), linears=len(matrix.sums), hessian=False,
        calibration=calibration, seconds=time.perf_counter() - started,
    )  # fmt: skip
