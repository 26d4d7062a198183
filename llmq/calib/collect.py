"""Observe linear inputs while a layer runs: the one place llmq collects calibration statistics,
used by `llmq calibrate` (whole model) and by the quantization pipeline (layer by layer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from llmq.calib.stats import CalibStats, InputStats
from llmq.calib.stream import LayerStream, input_hooks
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress


def shared_input_owners(stream: LayerStream, names: list[str]) -> dict[str, str]:
    """Each linear -> the first present linear of its shared-input group (q/k/v -> q)."""
    owners = {}
    for group in stream.layout.sequential:
        present = [name for name in group if name in names]
        for name in present:
            owners[name] = present[0]
    return owners


def run_observed(
    stream: LayerStream,
    layer: nn.Module,
    names: list[str],
    hidden: Tensor,
    *,
    hessian: bool,
    samples: bool = False,
    on_batch: Callable[[], Any] | None = None,
    keep: int | None = None,
    in_place: bool = False,
) -> tuple[Tensor, dict[str, InputStats]]:
    """Run `layer` on `hidden` and return its output (all of it, the first `keep` samples, or
    written over `hidden` when `in_place`: see `LayerStream.run_layer`) and the input statistics
    of the named linears (with sample rows when `samples`); linears that share an input share
    one InputStats (computed once)."""
    owners = shared_input_owners(stream, names)
    observed: dict[str, InputStats] = {}

    def observe(name: str, x: Tensor) -> None:
        if owners[name] != name:
            return
        if name not in observed:
            observed[name] = InputStats.empty(
                x.shape[-1], hessian=hessian, device=x.device, samples=samples
            )
        observed[name].update(x)

    with input_hooks(layer, names, observe):
        output = stream.run_layer(layer, hidden, on_batch=on_batch, keep=keep, in_place=in_place)
    return output, {name: observed[owner] for name, owner in owners.items()}


def collect_stats(
    ckpt: Checkpoint,
    input_ids: Tensor,
    *,
    hessian: bool = False,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> CalibStats:
    """Statistics of every linear input of every layer, on the float model's activations."""
    stream = LayerStream(ckpt, device=device)
    hidden = stream.embed(input_ids)
    stats = CalibStats()
    names = list(stream.layout.linears)
    with progress.stage("calibrating layers", total=ckpt.num_layers) as advance:
        for index in range(ckpt.num_layers):
            layer = stream.load_layer(index)
            batches = len(list(stream.batches(hidden)))
            with progress.stage(f"layer {index}", total=batches, transient=True) as step:
                hidden, observed = run_observed(
                    stream, layer, names, hidden, hessian=hessian, on_batch=lambda: step(1),
                    in_place=True,
                )  # fmt: skip
            prefix = stream.layout.layer_prefix(index)
            stats.inputs.update({prefix + name: s for name, s in observed.items()})
            advance(1)
    return stats
