"""Observe linear inputs while a layer runs: the one place llmq collects calibration statistics,
used by `llmq calibrate` (whole model) and by the quantization pipeline (layer by layer)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from llmq.calib.hooks import input_hooks
from llmq.calib.stats import CalibStats, InputStats, reduce_stats
from llmq.calib.stream import BlockOutput, LayerStream
from llmq.heap import ReusedBuffers
from llmq.io.checkpoint import Checkpoint
from llmq.io.layout import DecoderLayout
from llmq.processes import SINGLE_PROCESS, Processes
from llmq.progress import NO_PROGRESS, Progress


def shared_input_owners(layout: DecoderLayout, names: list[str]) -> dict[str, str]:
    """Each linear -> the first present linear of its shared-input group (q/k/v -> q)."""
    owners = {}
    for group in layout.sequential:
        present = [name for name in group if name in names]
        for name in present:
            owners[name] = present[0]
    return owners


class _Observer:
    """The input hook that accumulates each named linear's input statistics; linears that share
    an input share one InputStats (computed once, from the group's first linear)."""

    def __init__(
        self,
        layout: DecoderLayout,
        names: list[str],
        *,
        hessian: bool,
        samples: bool,
        magnitudes: bool = True,
        norms: bool = False,
    ) -> None:
        self.owners = shared_input_owners(layout, names)
        self.hessian, self.samples, self.magnitudes = hessian, samples, magnitudes
        self.norms = norms
        self.observed: dict[str, InputStats] = {}

    def __call__(self, name: str, x: Tensor) -> None:
        if self.owners[name] != name:
            return
        if name not in self.observed:
            self.observed[name] = InputStats.empty(
                x.shape[-1], hessian=self.hessian, device=x.device, samples=self.samples,
                magnitudes=self.magnitudes, norms=self.norms,
            )  # fmt: skip
        self.observed[name].update(x)

    def stats(self, processes: Processes = SINGLE_PROCESS) -> dict[str, InputStats]:
        """The statistics of each linear that saw input (an expert no token was routed to saw
        none), over all `processes`' windows."""
        observed = reduce_stats(self.observed, processes)
        return {name: observed[owner] for name, owner in self.owners.items() if owner in observed}


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
    norms: bool = False,
) -> tuple[Tensor, dict[str, InputStats]]:
    """Run `layer` on `hidden` and return its output (all of it, the first `keep` samples, or
    written over `hidden` when `in_place`: see `LayerStream.run_layer`) and the input statistics
    of the named linears (with sample rows when `samples`, sums of squares when `norms`)."""
    observer = _Observer(
        stream.layout_of(layer), names, hessian=hessian, samples=samples, norms=norms
    )
    with input_hooks(layer, names, observer):
        output = stream.run_layer(layer, hidden, on_batch=on_batch, keep=keep, in_place=in_place)
    return output, observer.stats(stream.processes)


def observe_until(
    stream: LayerStream,
    layer: nn.Module,
    names: list[str],
    hidden: Tensor,
    until: str,
    *,
    replace: dict[str, BlockOutput] | None = None,
    capture: bool = False,
    buffers: ReusedBuffers | None = None,
    on_batch: Callable[[], Any] | None = None,
    hessian: bool = True,
    norms: bool = False,
) -> tuple[dict[str, InputStats], Tensor | None]:
    """Run `layer` on `hidden` only up to module `until` (`LayerStream.run_until`); return the
    Hessians (and/or sums of squares, `norms`) of the named linears' inputs (which run before
    `until`, or are it; no magnitudes: the staged schedule serves methods that read these
    alone) and, when `capture`, `until`'s input for every sample, in the "capture" slot of
    `buffers` when given."""
    observer = _Observer(
        stream.layout_of(layer), names, hessian=hessian, samples=False, magnitudes=False,
        norms=norms,
    )  # fmt: skip
    captured = _Captured(len(hidden), buffers or ReusedBuffers()) if capture else None
    with (
        input_hooks(layer, names, observer),
        input_hooks(layer, [until], captured) if captured is not None else nullcontext(),
    ):
        stream.run_until(layer, hidden, until, replace=replace, on_batch=on_batch)
    return observer.stats(stream.processes), None if captured is None else captured.tensor


class _Captured:
    """An input hook that stores one module's inputs, batch after batch, in one tensor."""

    def __init__(self, samples: int, buffers: ReusedBuffers) -> None:
        self.samples, self.buffers = samples, buffers
        self.tensor: Tensor | None = None
        self.filled = 0

    def __call__(self, _name: str, x: Tensor) -> None:
        if self.tensor is None:
            self.tensor = self.buffers.take("capture", (self.samples, *x.shape[1:]), x)
        self.tensor[self.filled : self.filled + len(x)] = x
        self.filled += len(x)


@dataclass(slots=True, eq=False)
class ObservedLayer:
    """One float decoder layer after it ran: its linears' input statistics (none on a data-free
    walk), its inputs (when kept) and outputs. `module` is dropped once the walk moves on."""

    index: int
    prefix: str
    module: nn.Module
    stats: dict[str, InputStats]
    inputs: Tensor | None
    outputs: Tensor | None
    input_energy: float | None = None  # the mean square of its input (the residual stream)


def observed_layers(
    ckpt: Checkpoint,
    input_ids: Tensor | None,
    *,
    hessian: bool = False,
    norms: bool = False,
    keep_inputs: bool = False,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    label: str = "calibrating layers",
) -> Iterator[ObservedLayer]:
    """The float model's decoder layers in turn, each run on the previous one's output with its
    linears' inputs observed (`input_ids` None: a data-free walk, the weights alone).
    `keep_inputs`: also a copy of each layer's input (one more copy of the activations); the
    tensors a layer hands out are released when the walk moves on."""
    stream = LayerStream(ckpt, device=device)
    walk = stream.walk(
        None if input_ids is None else stream.embed(input_ids), progress=progress, label=label
    )
    for layer in walk:
        hidden, observed = layer.hidden, {}
        before = hidden.clone() if keep_inputs and hidden is not None else None
        energy = None
        if hidden is not None:
            energy = float(torch.linalg.vector_norm(hidden, dtype=torch.float64)) ** 2 / hidden.numel()  # fmt: skip
            names = list(stream.layout_of(layer.module).linears)
            batches = len(list(stream.batches(hidden)))
            with progress.stage(f"layer {layer.index}", total=batches, transient=True) as step:
                hidden, observed = run_observed(
                    stream, layer.module, names, hidden, hessian=hessian,
                    on_batch=lambda: step(1), in_place=True, norms=norms,
                )  # fmt: skip
        layer.advance(hidden)
        done = ObservedLayer(layer.index, layer.prefix, layer.module, observed, before, hidden, energy)  # fmt: skip
        del before, hidden
        yield done
        done.inputs = done.outputs = None


def collect_stats(
    ckpt: Checkpoint,
    input_ids: Tensor,
    *,
    hessian: bool = False,
    norms: bool = False,
    on_layer: Callable[[int, Tensor, Tensor], Any] | None = None,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> CalibStats:
    """Statistics of every linear input of every layer, on the float model's activations.
    `on_layer(index, inputs, outputs)` sees each layer's hidden states before and after it
    (a copy of the inputs is kept for it: one more copy of the activations)."""
    stats = CalibStats()
    for layer in observed_layers(
        ckpt, input_ids, hessian=hessian, norms=norms, keep_inputs=on_layer is not None,
        progress=progress, device=device,
    ):  # fmt: skip
        if on_layer is not None:
            on_layer(layer.index, layer.inputs, layer.outputs)
        stats.inputs.update({layer.prefix + name: s for name, s in layer.stats.items()})
    return stats
