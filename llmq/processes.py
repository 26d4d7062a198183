"""Data parallelism under `torchrun`: one process per device.

torchrun sets WORLD_SIZE, RANK and LOCAL_RANK; without them the run is one process. Processes
on GPUs talk over NCCL, on CPUs over gloo. In training every process sees its own slice of each
global batch (llmq.distillation.data) and DDP averages the gradients; in calibration every
process runs its share of the windows and the statistics are reduced (llmq.calib.stats). Only
process 0 writes files and reports progress.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from llmq.errors import InputError

T = TypeVar("T")


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

    def reduce(self, values: Tensor, op: str = "sum") -> None:
        """`values` summed ("sum") or maximised ("max") over all processes, in place (a CPU
        tensor for gloo, a GPU one for NCCL)."""
        if self.distributed:
            dist.all_reduce(values, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)

    def broadcast(self, value: T, src: int = 0, device: torch.device | None = None) -> T:
        """`value` as process `src` has it (any picklable object), in every process; with
        `device`, its tensors travel through the CPU and arrive there (a GPU tensor would
        otherwise arrive on the sender's GPU)."""
        if not self.distributed:
            return value
        box: list[Any] = [moved(value, "cpu") if device is not None and self.rank == src else value]
        if self.rank != src:
            box = [None]
        dist.broadcast_object_list(box, src=src)
        return box[0] if device is None else moved(box[0], device)

    def gather(self, value: T) -> list[T]:
        """Every process's `value`, in rank order, in every process."""
        if not self.distributed:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def on_main(self, work: Callable[[], T]) -> T:
        """`work` done by process 0 alone; its result, or its error raised, in every process
        (so that a refusal on process 0 cannot leave the others waiting)."""
        return self.shared(attempt(work) if self.is_main else None, 0)

    def shared(self, outcome: Outcome | None, src: int, device: torch.device | None = None) -> Any:
        """The value of process `src`'s `attempt`, in every process; its error raised in all."""
        done, value = self.broadcast(outcome, src, device)
        if not done:
            raise value
        return value


Outcome = tuple[bool, Any]  # (True, a result) or (False, the exception raised)


def attempt(work: Callable[[], T]) -> Outcome:
    """`work`'s result, or the exception it raised, to be shared with the other processes."""
    try:
        return True, work()
    except Exception as exc:  # raised again in every process by `Processes.shared`
        return False, exc


def moved(value: Any, device: torch.device | str) -> Any:
    """`value` with every tensor in it (in dataclasses, lists, tuples) on `device`."""
    if isinstance(value, Tensor):
        return value.to(device)
    if is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: moved(getattr(value, f.name), device) for f in fields(value) if f.init}
        return replace(value, **changes)
    if isinstance(value, list | tuple):
        return type(value)(moved(item, device) for item in value)
    return value


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
