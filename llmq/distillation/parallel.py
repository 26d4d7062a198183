"""Data parallelism under `torchrun`: one process per device, the student wrapped in DDP.

torchrun sets WORLD_SIZE, RANK and LOCAL_RANK; without them the run is one process. Processes
on GPUs talk over NCCL, on CPUs over gloo. Every process sees its own slice of each global
batch (llmq.distillation.data); DDP averages the gradients, so with equal slices the step is the
one-process step on the whole batch. Only process 0 writes files and reports progress.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from llmq.errors import InputError


@dataclass(frozen=True, slots=True)
class Processes:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def mean(self, value: float) -> float:
        """The mean of `value` over all processes."""
        if not self.distributed:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total.item()) / self.world_size

    def sum(self, values: Tensor) -> Tensor:
        """`values` summed over all processes (float64 on the CPU, for gloo)."""
        if not self.distributed:
            return values
        total = values.to("cpu", torch.float64)
        dist.all_reduce(total)
        return total


SINGLE_PROCESS = Processes()


def launched() -> Processes:
    """This process's place among torchrun's processes, as torchrun's variables say (nothing
    joined yet)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Processes()
    return Processes(
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def join_processes(device: torch.device) -> Processes:
    """This process's place among torchrun's processes, joining their group (once)."""
    processes = launched()
    if processes.world_size == 1:
        return processes
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return processes


def process_device(device: torch.device, processes: Processes) -> torch.device:
    """Each GPU process runs on its own GPU, the one torchrun's LOCAL_RANK names."""
    if device.type != "cuda" or not processes.distributed:
        return device
    if processes.local_rank >= torch.cuda.device_count():
        raise InputError(
            f"process {processes.rank} has LOCAL_RANK {processes.local_rank} but only "
            f"{torch.cuda.device_count()} GPUs are visible",
            hint="start at most one process per GPU (torchrun --nproc-per-node)",
        )
    return torch.device("cuda", processes.local_rank)


def leave_processes(processes: Processes) -> None:
    if processes.distributed and dist.is_initialized():
        dist.destroy_process_group()
