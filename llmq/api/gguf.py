"""`quantize --format gguf`: a checkpoint into one GGUF file for llama.cpp."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from llmq.api.common import _open
from llmq.config import GGUFRecipe
from llmq.errors import InputError
from llmq.progress import NO_PROGRESS, Progress


def quantize_gguf(
    model: str | Path,
    out: str | Path,
    recipe: GGUFRecipe,
    *,
    overwrite: bool = False,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Any:
    """Write MODEL as the GGUF file OUT with `recipe`'s scheme, overrides and importance
    matrix (read from `recipe.imatrix`, computed from `recipe.calibration`, or none) and, for
    `method` gptq, the calibration's Hessians for GPTQ's error feedback, computed layer by layer
    as the file is written. Returns a `llmq.gguf.export.GGUFResult`. Everything is checked
    before the calibration pass."""
    from llmq.gguf.export import check_gguf_output, export_gguf, plan_tensors
    from llmq.gguf.imatrix import imatrix_from_calibration, read_imatrix
    from llmq.gguf.mix import get_gguf_scheme, parse_tensor_types
    from llmq.gguf.statistics import FixedStatistics, Statistics, StreamedStatistics
    from llmq.gguf.tables import TABLES
    from llmq.io.atomic import refuse_inputs
    from llmq.pipeline.plan import refuse_quantized

    started = time.perf_counter()
    out = Path(out)
    scheme = get_gguf_scheme(recipe.scheme)
    overrides = parse_tensor_types(recipe.tensor_types)
    ckpt = _open(model, progress)
    refuse_quantized(ckpt.path, ckpt.config)  # GGUF is written from 16-bit weights
    plan = plan_tensors(ckpt, scheme, overrides)  # an unmapped family or tensor: refused now
    tables = sorted({t.qtype.name for t in plan if t.qtype in TABLES})
    if recipe.method == "gptq" and tables:
        raise InputError(
            f"--method gptq: GPTQ's error feedback runs on uniform grids, not on {', '.join(tables)}'s table",
            hint="drop --method gptq: the table types' scales are still searched against the importance matrix",
        )  # fmt: skip
    refuse_inputs(out, [("model", ckpt.path), ("imatrix", recipe.imatrix)])
    check_gguf_output(out, overwrite=overwrite)
    statistics: Statistics | None = None
    source = None
    if recipe.imatrix is not None:
        imatrix, source = read_imatrix(Path(recipe.imatrix)), recipe.imatrix
        if not set(imatrix.sums) & {tensor.name for tensor in plan}:
            raise InputError(
                f"--imatrix {recipe.imatrix}: names none of this model's tensors",
                hint="an imatrix is made for one model: llmq calibrate --imatrix, or llama-imatrix",
            )
        statistics = FixedStatistics(imatrix.importance())
    elif recipe.calibration is not None:
        cal = recipe.calibration
        source = f"{cal.num_samples} x {cal.seq_len} tokens of {cal.text}"
        if recipe.method == "gptq":
            statistics = StreamedStatistics(ckpt, cal, progress=progress, device=device)
        else:
            imatrix = imatrix_from_calibration(ckpt, cal, progress=progress, device=device)
            statistics = FixedStatistics(imatrix.importance())
    try:
        result = export_gguf(
            ckpt, out, scheme, overrides=overrides, statistics=statistics,
            importance_source=source, overwrite=overwrite, progress=progress,
        )  # fmt: skip
    finally:
        if isinstance(statistics, StreamedStatistics):
            statistics.close()
    result.seconds = time.perf_counter() - started  # the calibration pass included
    return result
