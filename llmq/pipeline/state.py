"""Resume state of an interrupted run, kept in the staging folder.

After each finished layer the pipeline writes that layer's shard; a resume point (the hidden
states that feed the next layer, then `state.json` listing the layers they follow) is saved at
most every `every_s` seconds. A run with --resume checks that the recipe and the source are the
same and continues after the resume point, redoing the layers finished since; outputs are
identical to an uninterrupted run because each layer sees the same inputs.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from llmq.config import RESUME_EVERY_S
from llmq.errors import InputError
from llmq.io.atomic import save_safetensors, write_json
from llmq.processes import SINGLE_PROCESS, Processes

STATE_FILE = "llmq-state.json"
HIDDEN_FILE = "llmq-hidden.safetensors"  # one process's; torchrun's: `hidden_file`


@dataclass(slots=True)
class RunState:
    staging: Path
    fingerprint: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)  # reports of finished layers
    every_s: float = RESUME_EVERY_S  # seconds between resume points; 0: after every layer
    processes: Processes = SINGLE_PROCESS  # torchrun's: each saves its own hidden states
    _last_save: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> int:
        return len(self.layers)

    def record(self, report: dict[str, Any], hidden: Tensor | None) -> None:
        """Keep the finished layer's report; save a resume point when `every_s` has passed
        since the last one (always when there are no hidden states: a JSON file is cheap)."""
        self.layers.append(report)
        due = hidden is None or time.monotonic() - self._last_save >= self.every_s
        if not self.processes.broadcast(due):  # process 0's clock decides for all
            return
        if hidden is not None:
            save_safetensors(
                self.staging / hidden_file(self.processes),
                {"hidden": hidden.cpu()},
                metadata={"after_layer": str(report["index"])},
            )
        self.processes.barrier()  # every process's hidden states saved before the state says so
        if self.processes.is_main:
            state = {"fingerprint": self.fingerprint, "layers": self.layers}
            write_json(self.staging / STATE_FILE, state)
        self._last_save = time.monotonic()

    def hidden(self) -> Tensor | None:
        path = self.staging / hidden_file(self.processes)
        if not path.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("after_layer") != str(self.done - 1):
                raise InputError(
                    f"{self.staging}: resume state is inconsistent", hint="rerun without --resume"
                )
            return f.get_tensor("hidden")


def remove_resume_points(staging: Path) -> None:
    """The state and every process's hidden states: a finished run needs none of them."""
    (staging / STATE_FILE).unlink(missing_ok=True)
    for path in staging.glob("llmq-hidden*.safetensors"):
        path.unlink()


def hidden_file(processes: Processes) -> str:
    """This process's resume point: the hidden states of its windows."""
    if not processes.distributed:
        return HIDDEN_FILE
    return f"llmq-hidden-{processes.rank}-of-{processes.world_size}.safetensors"


def load_state(
    staging: Path,
    fingerprint: dict[str, Any],
    every_s: float,
    processes: Processes = SINGLE_PROCESS,
) -> RunState | None:
    """The state of a partial run with the same fingerprint, or None when there is none."""
    path = staging / STATE_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise InputError(f"{path}: corrupt resume state", hint="rerun without --resume") from None
    recorded = saved.get("fingerprint") or {}
    if recorded != fingerprint:
        parallel = "processes" in recorded or "processes" in fingerprint
        raise InputError(
            f"{staging}: the partial run used a different model or recipe"
            + (" or number of torchrun processes" if parallel else ""),
            hint="rerun without --resume to start over",
        )
    return RunState(staging, fingerprint, saved["layers"], every_s, processes)


def resume_point_bytes(windows: int, seq_len: int, hidden_size: int) -> int:
    """Disk a resume point needs at its peak: the hidden states (at most float32) twice, the
    new one being written before the old one is replaced."""
    return 2 * windows * seq_len * hidden_size * 4


def keep_if_resumable(staging: Path, command_hint: str) -> str | None:
    """After a failed run: keep the staging folder when it holds a resume point and say how to
    continue; remove it when it holds nothing worth keeping."""
    if (staging / STATE_FILE).is_file():
        return f"the finished layers are kept in {staging}: {command_hint}"
    shutil.rmtree(staging, ignore_errors=True)
    return None
