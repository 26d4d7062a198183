"""Tensors a checkpoint shows in place of those it stores.

Some checkpoints store tensors in a form llmq's pipeline does not work on: GPT-OSS's experts
fused in 3-D tensors (llmq.io.fused_experts), FP8 block releases' weights as codes and factors
(llmq.io.fp8_release). `open_checkpoint` then shows other names (each expert's linear; the
bfloat16 weight), each a `TensorView` over the stored tensors it hides, so every reader (plans,
layer streams, writers) sees plain tensors under the names it expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from llmq.io.checkpoint import TensorInfo


class StoredReader(Protocol):
    def __call__(self, name: str, index: int | None = None) -> Tensor:
        """Stored tensor `name`, or only its entry `index` along the first dimension."""
        ...


class TensorView(Protocol):
    def read(self, stored: StoredReader) -> Tensor:
        """The tensor shown, from the stored ones."""
        ...


@dataclass(slots=True)
class ShownTensors:
    """A checkpoint's tensors as shown: the names readers see (with each one's entry), the
    stored tensors hidden behind views, and the view of each name that is not stored."""

    shown: dict[str, TensorInfo]
    hidden: dict[str, TensorInfo] = field(default_factory=dict)
    views: dict[str, TensorView] = field(default_factory=dict)

    def hide(self, names: set[str]) -> None:
        """Move the stored tensors `names` from the shown ones to the hidden ones."""
        for name in names:
            self.hidden[name] = self.shown.pop(name)
