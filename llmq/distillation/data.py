"""Which training windows each optimizer step sees: a pure function of the step.

Windows are shuffled once per epoch by a generator seeded with (seed, epoch), and step s takes
positions [s·B, (s+1)·B) of the endless sequence of epochs (B: the global batch). A resumed run
therefore sees exactly the batches an uninterrupted one would, with no iterator state to save,
and every data-parallel process takes its own contiguous slice of the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_EPOCH_SEED_STRIDE = 1_000_003  # seeds of (seed, epoch) pairs never collide for epochs below it


@dataclass(frozen=True, slots=True)
class BatchOrder:
    windows: Tensor  # [count, seq_len] int64
    global_batch: int  # windows per optimizer step, all processes together
    seed: int

    def indices(self, step: int) -> list[int]:
        """The windows (rows of `windows`) of optimizer step `step` (0-based)."""
        count = self.windows.shape[0]
        start = step * self.global_batch
        order: dict[int, list[int]] = {}
        picked = []
        for position in range(start, start + self.global_batch):
            epoch, offset = divmod(position, count)
            if epoch not in order:
                order[epoch] = self._permutation(epoch)
            picked.append(order[epoch][offset])
        return picked

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> Tensor:
        """This process's windows of step `step`: [global_batch / world_size, seq_len]."""
        share = self.global_batch // world_size
        mine = self.indices(step)[rank * share : (rank + 1) * share]
        return self.windows[mine]

    def epochs(self, steps: int) -> float:
        """How many passes over the data `steps` optimizer steps make."""
        return steps * self.global_batch / self.windows.shape[0]

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * _EPOCH_SEED_STRIDE + epoch)
        return torch.randperm(self.windows.shape[0], generator=generator).tolist()
