"""What a GGUF export weighs its rounding by: per weight, the importance matrix (each input's
mean square) and, for GPTQ, the input Hessian.

Two sources. `FixedStatistics` holds them for the whole model at once: an imatrix file's, or
the calibration pass's sums of squares (small: one vector a linear). `StreamedStatistics` walks
the float model's calibration pass one decoder layer at a time as the writer reaches each
layer's tensors (the plan is in layer order), and drops a layer's Hessians when it moves on:
GPTQ's memory stays one layer's Hessians (about 1 GB at Llama-3-8B's widths) whatever the depth.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol

import numpy as np
from torch import Tensor

from llmq.calib.collect import ObservedLayer, observed_layers
from llmq.calib.stats import CalibStats
from llmq.calib.windows import model_windows
from llmq.config import CalibConfig
from llmq.gguf.imatrix import imatrix_from_stats
from llmq.gguf.model import gguf_layer
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress

_LAYER = re.compile(r"\.layers\.(\d+)\.")  # a checkpoint name's decoder layer


class Statistics(Protocol):
    def importance(self, name: str) -> np.ndarray | None:
        """The importance [cols] ([experts, cols] stacked) of the weight GGUF calls `name`."""

    def hessian(self, source: str) -> Tensor | None:
        """The input Hessian [cols, cols] of the checkpoint's weight `source` (None: round to nearest)."""


class FixedStatistics:
    def __init__(self, importance: dict[str, np.ndarray] | None = None, hessians: dict[str, Tensor] | None = None) -> None:  # fmt: skip
        self._importance, self._hessians = importance or {}, hessians or {}

    def importance(self, name: str) -> np.ndarray | None:
        return self._importance.get(name)

    def hessian(self, source: str) -> Tensor | None:
        return self._hessians.get(source)


class StreamedStatistics:
    """The calibration pass walked on demand: asking for layer i's statistics runs the float
    model up to layer i; layers must be asked for in order."""

    def __init__(self, ckpt: Checkpoint, calibration: CalibConfig, *, progress: Progress = NO_PROGRESS, device: str | None = None) -> None:  # fmt: skip
        self._ckpt, self._calibration = ckpt, calibration
        windows = model_windows(ckpt.path, calibration, progress)
        self._walk: Iterator[ObservedLayer] = observed_layers(
            ckpt, windows.input_ids, hessian=True, norms=True, progress=progress, device=device
        )
        self._layer = -1
        self._stats = CalibStats()
        self._importance: dict[str, np.ndarray] = {}

    def _reach(self, layer: int) -> None:
        if layer < self._layer:
            raise RuntimeError(f"layer {layer} asked for after layer {self._layer}")
        while self._layer < layer:
            observed = next(self._walk)
            self._layer = observed.index
            self._stats = CalibStats()  # the previous layer's Hessians released
            self._stats.inputs.update({observed.prefix + name: s for name, s in observed.stats.items()})  # fmt: skip
            self._importance = imatrix_from_stats(self._ckpt, self._stats, self._calibration).importance()  # fmt: skip

    def importance(self, name: str) -> np.ndarray | None:
        layer = gguf_layer(name)
        if layer < 0:
            return None
        self._reach(layer)
        return self._importance.get(name)

    def hessian(self, source: str) -> Tensor | None:
        found = _LAYER.search(source)
        if found is None:
            return None
        self._reach(int(found.group(1)))
        observed = self._stats.inputs.get(source.removesuffix(".weight"))
        return None if observed is None or observed.hessian is None else observed.hessian.cpu()

    def close(self) -> None:
        self._walk.close()  # type: ignore[attr-defined]
