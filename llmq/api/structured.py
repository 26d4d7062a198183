"""`prune_structured`: a smaller dense model (fewer MLP channels, key-value groups, layers),
scored on calibration windows, written one decoder layer at a time."""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmq import __version__
from llmq.api.common import _open, options_of
from llmq.config import StructuredOptions
from llmq.errors import InputError
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
    from llmq.io.atomic import (
        check_free_space,
        check_output_dir,
        claim_output,
        publish,
        refuse_inputs,
        staging_path,
    )
    from llmq.pipeline.output import weights_size
    from llmq.pruning.structured import (
        Importance,
        Targets,
        budget_targets,
        count_parameters,
        kept_sizes,
        plan_structured,
    )

    started = time.perf_counter()
    o = options_of(StructuredOptions, options, values)
    ckpt = _open(model, progress)
    _check_family(ckpt)
    targets = Targets(o.intermediate_size, o.num_kv_heads, o.num_layers, o.hidden_size, o.num_heads)  # fmt: skip
    if o.params is not None and o.decoder_params is not None:
        raise InputError("--params and --decoder-params: give one (a share of all the parameters, or of the decoder layers')")  # fmt: skip
    share = o.params if o.params is not None else o.decoder_params
    if share is not None:
        decoder = o.params is None
        targets = budget_targets(ckpt.config, ckpt.layout.layers, share, decoder=decoder, given=targets)  # fmt: skip
    if targets == Targets():
        raise InputError("nothing to remove", hint="give --params, --intermediate-size, --num-kv-heads, --num-heads, --hidden-size or --num-layers")  # fmt: skip
    kept_sizes(ckpt.config, targets)  # before the scoring pass
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
            scores = _score(ckpt, windows.input_ids, progress, device)
            if o.depth_metric == "ppl":
                scores.blocks = _depth_by_perplexity(ckpt, windows.input_ids, progress, device)
            source = "computed" if o.depth_metric == "block" else "computed, layers by perplexity"
            calibration = {**cal.model_dump(), "tokens": windows.num_tokens}
            if save_importance is not None:
                scores.save(Path(save_importance))
        plan = plan_structured(ckpt.config, scores, targets)
        counts = {
            "source": count_parameters(ckpt.config, ckpt.layout.layers).to_dict(),
            "output": count_parameters(plan.config, ckpt.layout.layers).to_dict(),
        }
        if space_check:
            check_free_space(out, _output_bytes(ckpt, plan.config))
        staging = staging_path(out)
        record = {
            "llmq_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source_model": str(model),
            "recipe": o.model_dump(mode="json", exclude=REPORT_ONLY),
            "structured": {
                "removed": plan.removed(ckpt.config),
                "importance": source,
                "parameters": counts,
                "budget": _budget(o.params, o.decoder_params, counts),
            },
            "calibration": calibration,
        }
        try:
            _write(ckpt, plan, staging, record, progress, device, reference=reference)
        except BaseException:  # no resume point: nothing partial is kept
            shutil.rmtree(staging, ignore_errors=True)
            raise
        publish(staging, out)

    stored = {"source": _stored(ckpt), "output": _stored(_open(out))}
    result = StructuredResult(
        out_dir=out, model=str(model), removed=plan.removed(ckpt.config),
        parameters={k: total for k, (total, _) in stored.items()},
        decoder_parameters={k: decoder for k, (_, decoder) in stored.items()},
        size_bytes={"source": weights_size(ckpt.path), "output": weights_size(out)},
        importance=source, calibration=calibration, budget=record["structured"]["budget"],
    )  # fmt: skip
    if o.evaluate:
        result.perplexity = _perplexities(ckpt.path, out, progress, device)
    result.seconds = time.perf_counter() - started
    return result


def _stored(ckpt: Any) -> tuple[int, int]:
    """Parameters as stored (a tied lm_head once): all of them, the decoder layers'."""
    layers = ckpt.layout.layers + "."
    sizes = {name: math.prod(info.shape) for name, info in ckpt.tensors.items()}
    return sum(sizes.values()), sum(n for name, n in sizes.items() if name.startswith(layers))


def _budget(
    params: float | None, decoder_params: float | None, counts: dict[str, dict[str, int]]
) -> dict[str, Any] | None:
    """The share asked for and the share reached, or None without --params/--decoder-params."""
    if params is None and decoder_params is None:
        return None
    part = "total" if params is not None else "decoder"
    return {
        "option": "--params" if params is not None else "--decoder-params",
        "share": params if params is not None else decoder_params,
        "reached": counts["output"][part] / counts["source"][part],
    }


def _check_family(ckpt: Any) -> None:
    if ckpt.quantization_config:
        raise InputError(f"{ckpt.path}: quantized", hint="prune the original float checkpoint")
    if ckpt.layout.linears != (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    ):  # fmt: skip
        raise InputError(
            f"{ckpt.path}: structured pruning knows Llama-style attention and gated MLPs only "
            f"(model_type {ckpt.config.get('model_type')!r})"
        )


def _score(ckpt: Any, ids: Any, progress: Progress, device: str | None) -> Any:
    from llmq.pruning.structured import score_model

    with progress.stage("scoring heads, channels and layers"):
        return score_model(ckpt, ids, progress=progress, device=device)


def _depth_by_perplexity(ckpt: Any, ids: Any, progress: Progress, device: str | None) -> Any:
    from llmq.pruning.structured import depth_by_perplexity

    return depth_by_perplexity(ckpt, ids, progress=progress, device=device)


def _output_bytes(ckpt: Any, config: dict[str, Any]) -> int:
    from llmq.io.checkpoint import torch_dtype
    from llmq.pruning.structured import parameter_count

    itemsize = max(torch_dtype(info.dtype).itemsize for info in ckpt.tensors.values())
    return parameter_count(config) * itemsize + 64 * 1024


def _write(
    ckpt: Any,
    plan: Any,
    staging: Path,
    record: dict[str, Any],
    progress: Progress,
    device: str | None,
    *,
    reference: bool,
) -> None:
    """Shard 0: embeddings, final norm, lm_head as they are; shard i + 1: kept layer i,
    renumbered and sliced; then the index, config, side files and llmq.json."""
    from llmq.io.atomic import save_safetensors
    from llmq.pipeline.output import ShardNames, finish_checkpoint, non_layer_tensors
    from llmq.pruning.structured import slice_layer, slice_outer

    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shards = ShardNames(len(plan.layers))
    outer = slice_outer(non_layer_tensors(ckpt), plan.hidden, ckpt.layout)
    save_safetensors(staging / shards.name(0), outer)
    with progress.stage("writing layers", total=len(plan.layers)) as advance:
        for new, (old, channels, groups, heads) in enumerate(
            zip(plan.layers, plan.channels, plan.kv_groups, plan.query_heads, strict=True)
        ):
            source, target = ckpt.layout.layer_prefix(old), ckpt.layout.layer_prefix(new)
            tensors = {n[len(source) :]: ckpt.read(n) for n in ckpt.names_with_prefix(source)}
            sliced = slice_layer(tensors, channels, groups, heads, ckpt.config, plan.hidden)
            save_safetensors(
                staging / shards.name(new + 1), {target + n: t for n, t in sliced.items()}
            )
            advance(1)
    with progress.stage("writing config, index and the reference for `llmq verify`"):
        finish_checkpoint(
            ckpt.path, staging, shards, plan.config, record, device, reference=reference
        )


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
