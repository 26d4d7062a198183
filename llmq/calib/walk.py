"""The one loop over a model's decoder layers: materialize a layer, let the caller run it on the
hidden states, take its output as the next layer's input, drop the layer.

Quantization, calibration, perplexity and structured scoring all walk a model this way
(`LayerStream.walk`); what they do with a layer is the loop's body:

    walk = stream.walk(stream.embed(input_ids), progress=progress, label="layers")
    for layer in walk:
        layer.advance(stream.run_layer(layer.module, layer.hidden, in_place=True))
    last = walk.hidden  # the last layer's output
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import Tensor, nn

from llmq.heap import reused_heap
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:
    from llmq.calib.stream import LayerStream

H = TypeVar("H", bound=Tensor | None)
"""The hidden states a walk carries: Tensor, or None on a data-free walk (RTN without data)."""


@dataclass(slots=True, eq=False)
class StreamedLayer(Generic[H]):
    """One decoder layer of a walk. `module` and `hidden` are dropped once the loop moves on."""

    index: int
    prefix: str  # the layer's module prefix, e.g. "model.layers.3."
    module: nn.Module  # materialized on the stream's device, in inference mode
    hidden: H  # its input [samples, seq, hidden]
    started: float  # time.perf_counter() when its reading began: its time includes the read
    output: H | None = None
    advanced: bool = False

    def advance(self, output: H) -> None:
        """Hand back the layer's output (`hidden` itself after an in-place run, None on a
        data-free walk): the next layer's input."""
        self.output, self.advanced = output, True


class LayerWalk(Generic[H]):
    """Iterates over a model's decoder layers from `start`, one materialized at a time; each
    layer's input is the output the previous one handed back. `hidden` is the current hidden
    states: after the loop, the last layer's output. Progress: one stage `label`, advanced
    once per layer (layers before `start` count as done)."""

    def __init__(
        self,
        stream: LayerStream,
        hidden: H,
        *,
        start: int = 0,
        progress: Progress = NO_PROGRESS,
        label: str = "layers",
    ) -> None:
        self.stream, self.hidden, self.start = stream, hidden, start
        self.progress, self.label = progress, label

    def __len__(self) -> int:
        return self.stream.num_layers - self.start

    def __iter__(self) -> Iterator[StreamedLayer[H]]:
        stream = self.stream
        with (
            self.progress.stage(self.label, total=stream.num_layers) as advance,
            reused_heap(),  # every op's output is a fresh tensor: 5-10% of a CPU layer was faults
        ):
            if self.start:
                advance(self.start)
            for index in range(self.start, stream.num_layers):
                started = time.perf_counter()
                with torch.inference_mode():  # layers only run forward
                    module = stream.load_layer(index)
                prefix = stream.layout.layer_prefix(index)
                layer = StreamedLayer(index, prefix, module, self.hidden, started)
                del module
                yield layer
                if not layer.advanced:
                    raise RuntimeError(f"layer {index}: its output was not handed back (advance)")
                self.hidden = layer.output  # type: ignore[assignment]  # H, as handed back
                del layer.module, layer.hidden  # the caller's step no longer holds them
                layer.output = None
                advance(1)
