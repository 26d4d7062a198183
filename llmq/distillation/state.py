"""The training state an interrupted `distill` resumes from, kept in the output's staging folder.

A resume point is a folder `.distill/step-NNNNNNN/` holding the student's parameters (float32
safetensors), the optimizer's state and the random generators (`optimizer.pt`) and the progress
(`state.json`); `.distill/latest` names the newest complete one and is rewritten atomically
after the folder is whole, so a run killed at any moment leaves a consistent resume point.
Older points are removed after the pointer moves. `.distill/best.safetensors` holds the
student with the lowest held-out perplexity so far. Training is deterministic, so a resumed run
that passes a best point again rewrites it with the same weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmq.errors import InputError
from llmq.io.atomic import save_safetensors, write_json, write_text
from llmq.processes import SINGLE_PROCESS, Processes

STATE_DIR = ".distill"
_POINTER = "latest"
_BEST = "best.safetensors"


@dataclass(slots=True)
class TrainState:
    """Where training stands: what the report and a resumed run need."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # training tokens seen, all processes together
    losses: list[float] = field(default_factory=list)  # mean loss of each step
    sparsity: list[float] = field(default_factory=list)  # GMP: the schedule's target each step
    evals: list[dict[str, float]] = field(default_factory=list)  # {step, tokens, perplexity}
    best_step: int | None = None
    best_perplexity: float | None = None
    seconds: float = 0.0  # wall time of the loop, evaluations and resume points included
    step_seconds: float = 0.0  # time in training steps alone (what tokens/s is measured on)

    def record_eval(self, perplexity: float) -> bool:
        """Record a held-out perplexity at the current step; True when it is the best yet."""
        self.evals.append({"step": self.step, "tokens": self.tokens, "perplexity": perplexity})
        if self.best_perplexity is not None and perplexity >= self.best_perplexity:
            return False
        self.best_step, self.best_perplexity = self.step, perplexity
        return True


def parameters_of(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters by name, each once (a tied lm_head is the embedding)."""
    return dict(model.named_parameters())


def save_state(
    staging: Path,
    state: TrainState,
    parameters: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    fingerprint: dict[str, Any],
    buffers: dict[str, Tensor] | None = None,
    *,
    processes: Processes = SINGLE_PROCESS,
    sharded: nn.Module | None = None,
) -> None:
    """Write a resume point (every process calls this). `buffers`: other tensors the loop
    carries between steps (GMP's running input norms), each process's own. `sharded`: the FSDP
    student, whose shards and AdamW state every process writes itself; otherwise process 0
    writes them."""
    root = staging / STATE_DIR
    point = root / f"step-{state.step:07d}"
    if processes.is_main:
        shutil.rmtree(point, ignore_errors=True)
        point.mkdir(parents=True)
    processes.barrier()
    torch.save(buffers or {}, point / _buffers_file(processes.rank))
    if sharded is not None:
        from llmq.distillation.sharding import save_sharded

        save_sharded(point, sharded, optimizer)
    processes.barrier()
    if not processes.is_main:
        return
    optimizer_state = None
    if sharded is None:
        save_safetensors(point / "student.safetensors", _cpu(parameters))
        optimizer_state = optimizer.state_dict()
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    extra = {"optimizer": optimizer_state, "rng": rng}
    torch.save(extra, point / "optimizer.pt")
    write_json(point / "state.json", {"fingerprint": fingerprint, "state": asdict(state)})
    write_text(root / _POINTER, point.name)
    for old in root.glob("step-*"):
        if old != point:
            shutil.rmtree(old, ignore_errors=True)


def load_state(
    staging: Path,
    parameters: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    fingerprint: dict[str, Any],
    buffers: dict[str, Tensor] | None = None,
    *,
    rank: int = 0,
    sharded: nn.Module | None = None,
) -> TrainState | None:
    """Restore the newest resume point into the student, the optimizer and `buffers` (in
    place); None when there is none. A point from another configuration or other models is
    refused. `sharded`: the FSDP student, each process reading its own shards."""
    root = staging / STATE_DIR
    if not (root / _POINTER).is_file():
        return None
    point = root / (root / _POINTER).read_text().strip()
    try:
        saved = json.loads((point / "state.json").read_text())
        extra = torch.load(point / "optimizer.pt", weights_only=True)
        saved_buffers = torch.load(point / _buffers_file(rank), weights_only=True)
    except (OSError, ValueError, RuntimeError):
        raise InputError(f"{point}: unreadable resume point", hint="rerun without --resume") from None  # fmt: skip
    if saved["fingerprint"] != fingerprint:
        raise InputError(
            f"{staging}: the interrupted run had other models or other settings",
            hint="rerun it with the same options, or without --resume to start over",
        )
    if sharded is not None:
        from llmq.distillation.sharding import load_sharded

        load_sharded(point, sharded, optimizer)
    else:
        _load_student(point, parameters)
        optimizer.load_state_dict(extra["optimizer"])
    for name, buffer in (buffers or {}).items():
        buffer.copy_(saved_buffers[name])
    torch.set_rng_state(extra["rng"]["cpu"])
    if "cuda" in extra["rng"]:
        torch.cuda.set_rng_state_all(extra["rng"]["cuda"])
    return TrainState(**saved["state"])


def _buffers_file(rank: int) -> str:
    return f"buffers-{rank}.pt"


def _load_student(point: Path, parameters: dict[str, nn.Parameter]) -> None:
    from safetensors.torch import load_file

    try:
        weights = load_file(str(point / "student.safetensors"))
    except (OSError, ValueError, RuntimeError):
        raise InputError(f"{point}: unreadable resume point", hint="rerun without --resume") from None  # fmt: skip
    with torch.no_grad():
        for name, param in parameters.items():
            param.copy_(weights[name])


def has_resume_point(staging: Path) -> bool:
    return (staging / STATE_DIR / _POINTER).is_file()


def save_best(staging: Path, parameters: dict[str, nn.Parameter]) -> None:
    (staging / STATE_DIR).mkdir(parents=True, exist_ok=True)
    save_safetensors(staging / STATE_DIR / _BEST, _cpu(parameters))


def save_best_state(staging: Path, state: dict[str, Tensor]) -> None:
    """The best student as a whole state dict (gathered from an FSDP student)."""
    (staging / STATE_DIR).mkdir(parents=True, exist_ok=True)
    save_safetensors(staging / STATE_DIR / _BEST, {k: v.detach().to("cpu") for k, v in state.items()})  # fmt: skip


def load_best_state(staging: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(staging / STATE_DIR / _BEST))


def load_best(staging: Path, parameters: dict[str, nn.Parameter]) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(staging / STATE_DIR / _BEST))
    with torch.no_grad():
        for name, param in parameters.items():
            param.copy_(weights[name])


def remove_state(staging: Path) -> None:
    shutil.rmtree(staging / STATE_DIR, ignore_errors=True)


def _cpu(parameters: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    return {name: p.detach().to("cpu") for name, p in parameters.items()}
