"""Fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`) for `distill
--sharding fsdp`: each process holds 1/N of the student's parameters, gradients and AdamW state
and 1/N of the teacher, gathering one decoder layer at a time for its forward and backward.

DDP replicates all of it in every process, which an 8B teacher and student do not fit. Under
FSDP the parameters are DTensors sharded by rows (dim 0), so every row of a linear lives whole in
one process: per-row pruning masks (llmq.quant.masks, GMP) work on the local rows alone
(`local`). Resume points are written with torch.distributed.checkpoint, each process its own
shards (`save_sharded`), and the student is gathered whole into process 0 only to be written
(`full_state`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

SHARDED_DIR = "sharded"  # the torch.distributed.checkpoint folder inside a resume point


def shard(model: nn.Module, layers: str) -> None:
    """fully_shard each decoder layer (the module list at `layers`), then the rest at the root
    (embedding, final norm, lm_head: tied weights stay together)."""
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    if device.type == "cuda":  # FSDP's default mesh takes the current GPU as this process's
        torch.cuda.set_device(device)
    for layer in model.get_submodule(layers):
        fully_shard(layer)
    fully_shard(model)


def local(tensor: Tensor) -> Tensor:
    """This process's rows of a sharded tensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_masks(masks: dict[str, Tensor], parameters: dict[str, nn.Parameter]) -> dict[str, Tensor]:  # fmt: skip
    """Whole-weight masks cut to the rows each process holds of their (sharded) parameters."""
    cut = {}
    for name, mask in masks.items():
        param = parameters[name]
        if isinstance(param, DTensor):
            mask = distribute_tensor(mask, param.device_mesh, param.placements).to_local()
        cut[name] = mask
    return cut


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """FSDP's counterpart of DDP's no_sync: reduce gradients on this backward or keep them."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """The student's whole state dict on the CPU of process 0 (empty elsewhere); every process
    must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_sharded(point: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every process writes its shards of the student and of AdamW's state into the resume
    point (a shared folder: one file per process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=point / SHARDED_DIR)  # fmt: skip


def load_sharded(point: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=point / SHARDED_DIR)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])  # fmt: skip
