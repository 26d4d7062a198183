"""`prune_structured`: a smaller dense model (fewer MLP channels, key-value groups, layers),
scored on calibration windows, written one decoder layer at a time."""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmq.api.common import _open, options_of
from llmq.config import StructuredOptions
from llmq.io.record import OutputRecord
from llmq.progress import NO_PROGRESS, Progress
from llmq.texts import text_inputs

REPORT_ONLY = {"evaluate", "save_importance"}  # options that change no byte of the checkpoint


@dataclass(slots=True)
class StructuredResult:
    out_dir: Path
    model: str
    removed: dict[str, Any]  # per axis: what went (StructuredPlan.removed)
    parameters: dict[str, int]  # "source", "output": all of them (a tied lm_head once)
    decoder_parameters: dict[str, int]  # "source", "output": the decoder layers'
    size_bytes: dict[str, int]  # "source", "output"
    importance: str  # the file the scores came from, or "computed"
    calibration: dict[str, Any] | None
    budget: dict[str, Any] | None = None  # --params / --decoder-params: option, share, reached
    seconds: float = 0.0
    perplexity: dict[str, Any] = field(default_factory=dict)  # source, output, protocol

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out_dir": str(self.out_dir)}


def prune_structured(
    model: str | Path,
    out: str | Path,
    options: StructuredOptions | None = None,
    *,
    overwrite: bool = False,
    space_check: bool = True,
    reference: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    **values: Any,
) -> StructuredResult:
    """Remove MODEL's least important MLP channels, key-value groups (with their query heads),
    hidden channels and decoder layers down to the targets, the same width in every layer, and
    write a plain checkpoint at OUT. `params` (or `decoder_params`): the MLP width that keeps
    the nearest to that share of all the parameters (of the decoder layers'), the other
    targets as given. Importance is scored on the calibration windows (or read from
    `importance`, a file a previous run saved with `save_importance`). `depth_metric`: layers
    ranked by Block Importance ("block") or by the perplexity increase from dropping each alone
    ("ppl": about layers² / 2 more layer passes, on the first 16 windows). `evaluate`: held-out
    perplexity of the source and the result (the default protocol of `evaluate`)."""
    from llmq.calib.windows import model_windows
    from llmq.io.atomic import check_output_dir, claim_output, publish, refuse_inputs, staging_path
    from llmq.io.space import check_free_space
    from llmq.pipeline.output import ShardNames, finish_checkpoint, weights_size
    from llmq.pruning.structured import (
        Importance,
        Targets,
        budget_reached,
        count_parameters,
        output_bytes,
        plan_structured,
        score_structured,
        stored_parameters,
        structured_roles,
        structured_targets,
        write_structured,
    )

    started = time.perf_counter()
    o = options_of(StructuredOptions, options, values)
    ckpt = _open(model, progress)
    structured_roles(ckpt)  # refuses a quantized checkpoint, a family without the roles
    given = Targets(o.intermediate_size, o.num_kv_heads, o.num_layers, o.hidden_size, o.num_heads)  # fmt: skip
    targets = structured_targets(ckpt, given, params=o.params, decoder_params=o.decoder_params)
    cal = o.calibration(o.samples)
    out = Path(out)
    importance, save_importance = o.importance, o.save_importance
    inputs = [("model", ckpt.path), ("importance file", importance), *text_inputs(o.calib_text, "calibration text")]  # fmt: skip
    if save_importance is not None:
        refuse_inputs(Path(save_importance), inputs)
    with claim_output(out, inputs=inputs):
        check_output_dir(out, overwrite=overwrite)
        if importance is not None:
            scores, source, calibration = Importance.load(Path(importance)), str(importance), None
        else:
            windows = model_windows(ckpt.path, cal, progress)
            scores = score_structured(
                ckpt, windows.input_ids, depth_metric=o.depth_metric, progress=progress,
                device=device,
            )  # fmt: skip
            source = "computed" if o.depth_metric == "block" else "computed, layers by perplexity"
            calibration = {**cal.model_dump(), "tokens": windows.num_tokens}
            if save_importance is not None:
                scores.save(Path(save_importance))
        plan = plan_structured(ckpt.config, scores, targets)
        counts = {
            "source": count_parameters(ckpt.config, ckpt.layout.layers),
            "output": count_parameters(plan.config, ckpt.layout.layers),
        }
        if space_check:
            check_free_space(out, output_bytes(ckpt, plan.config))
        staging = staging_path(out)
        budget = budget_reached(o.params, o.decoder_params, counts)
        record = OutputRecord(
            source_model=str(model),
            recipe=o.model_dump(mode="json", exclude=REPORT_ONLY),
            structured={
                "removed": plan.removed(ckpt.config),
                "importance": source,
                "parameters": {key: count.to_dict() for key, count in counts.items()},
                "budget": budget,
            },
            calibration=calibration,
        )
        shards = ShardNames.per_layer(len(plan.layers))
        try:
            write_structured(ckpt, plan, staging, shards.name, progress=progress)
            with progress.stage("writing config, index and the reference for `llmq verify`"):
                finish_checkpoint(
                    ckpt.path, staging, shards, plan.config, record, device, reference=reference
                )
        except BaseException:  # no resume point: nothing partial is kept
            shutil.rmtree(staging, ignore_errors=True)
            raise
        publish(staging, out)

    stored = {"source": stored_parameters(ckpt), "output": stored_parameters(_open(out))}
    result = StructuredResult(
        out_dir=out, model=str(model), removed=plan.removed(ckpt.config),
        parameters={key: count.total for key, count in stored.items()},
        decoder_parameters={key: count.decoder for key, count in stored.items()},
        size_bytes={"source": weights_size(ckpt.path), "output": weights_size(out)},
        importance=source, calibration=calibration, budget=budget,
    )  # fmt: skip
    if o.evaluate:
        result.perplexity = _perplexities(ckpt.path, out, progress, device)
    result.seconds = time.perf_counter() - started
    return result


def _perplexities(
    source: Path, out: Path, progress: Progress, device: str | None
) -> dict[str, Any]:
    from llmq.api.evaluate import evaluate

    result = evaluate(out, baseline=source, progress=progress, device=device)
    return {
        "source": result.baseline.perplexity,
        "output": result.model.perplexity,
        "increase": result.increase,
        "protocol": result.protocol,
    }
