"""`quantize --format gguf`: a checkpoint into one GGUF file for llama.cpp."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.api.common import _open
from llmq.config import GGUFRecipe
from llmq.errors import InputError
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:  # imported when used: the CLI's start-up stays light
    from llmq.gguf.budget import TypeBudget
    from llmq.io.checkpoint import Checkpoint


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
    from llmq.gguf.budget import plan_type_budget, written_sizes
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
    budget = None
    if recipe.mixed is not None:
        budget = plan_type_budget(ckpt, plan, recipe.mixed, overrides)  # refused now if unmet
        tables += sorted({c.qtype.name for c in budget.types if c.qtype in TABLES})
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
    record = None
    if budget is not None:
        chosen, record = choose_types(ckpt, budget, recipe, progress, device)
        overrides = chosen + overrides  # the choice names each tensor exactly; pins kept out
    try:
        result = export_gguf(
            ckpt, out, scheme, overrides=overrides, statistics=statistics,
            importance_source=source, overwrite=overwrite, progress=progress,
        )  # fmt: skip
    finally:
        if isinstance(statistics, StreamedStatistics):
            statistics.close()
    if budget is not None:
        assert record is not None
        result.mixed_precision = {**record, **written_sizes(out, budget)}
    result.seconds = time.perf_counter() - started  # the calibration pass included
    return result


def choose_types(
    ckpt: Checkpoint, budget: TypeBudget, recipe: GGUFRecipe, progress: Progress, device: str | None
) -> tuple[tuple[tuple[str, Any], ...], dict[str, Any]]:
    """The solver's types (as exact `--tensor-type` rules) and its record, damages measured on
    the recipe's calibration windows (none for `--sensitivity weight`)."""
    from llmq.calib.windows import model_windows
    from llmq.gguf.budget import chosen_types
    from llmq.mixed.choose import choose

    assert recipe.mixed is not None
    ids = None
    if recipe.mixed.sensitivity != "weight":
        assert recipe.calibration is not None  # GGUFRecipe's check
        ids = model_windows(ckpt.path, recipe.calibration, progress).input_ids
    chosen, record = choose(ckpt, budget.budget, ids, progress=progress, device=device)
    return chosen_types(budget, chosen), record
