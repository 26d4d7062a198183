"""The distillation loop: teacher forward without gradients, student forward and backward,
gradient accumulation, clipping, AdamW; held-out perplexity and resume points between steps.

`DistillRun` holds what the loop works on; the API builds it (models, data, resume) and says
what to do at a resume point and at a new best (`Hooks`), so this module writes no files.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmq.config import DistillConfig
from llmq.distillation.data import BatchOrder
from llmq.distillation.loss import distillation_loss
from llmq.distillation.masks import mask_gradients, mask_weights
from llmq.distillation.schedule import learning_rate
from llmq.distillation.state import TrainState
from llmq.processes import Processes
from llmq.progress import Progress


@dataclass(slots=True)
class DistillRun:
    config: DistillConfig
    teacher: nn.Module | None  # None for loss ce
    student: nn.Module  # the model itself (parameters, evaluation, writing)
    trained: nn.Module  # what the forward pass calls: the student, or DDP around it
    optimizer: torch.optim.Optimizer
    order: BatchOrder
    eval_ids: Tensor  # [windows, eval_seq_len], held-out
    parameters: dict[str, nn.Parameter]
    masks: dict[str, Tensor]
    layer_pairs: list[tuple[int, int]]  # (student, teacher) layers for the hidden-state loss
    processes: Processes
    device: torch.device
    state: TrainState
    input_norms: Any = None  # GMP with Wanda's metric: llmq.distillation.gmp.InputNorms
    sharded: bool = False  # FSDP: the student (and teacher) fully_shard-ed over the processes


@dataclass(frozen=True, slots=True)
class Hooks:
    save_state: Callable[[], None]  # write a resume point of the current state
    save_best: Callable[[], None]  # keep the current student as the best one
    checkpoint_every: int | None  # steps between resume points; None: by time
    checkpoint_every_s: float  # seconds between resume points when not by steps


def train(run: DistillRun, hooks: Hooks, progress: Progress) -> TrainState:
    """Train from `run.state.step` to `config.max_steps`, evaluating at the start (a fresh
    run), every `eval_every` steps and at the end."""
    config, state = run.config, run.state
    if not state.evals:
        _evaluate(run, hooks)
    last_save = time.monotonic()
    with progress.stage("distilling", total=config.max_steps) as advance:
        advance(state.step)
        for step in range(state.step, config.max_steps):
            step_started = time.monotonic()
            if config.gmp is not None:
                _prune(run, step)
            loss = train_step(run, step)
            state.step_seconds += time.monotonic() - step_started
            state.step = step + 1
            state.losses.append(loss)
            state.tokens += run.order.global_batch * config.seq_len
            if state.step == config.max_steps or (
                config.eval_every and state.step % config.eval_every == 0
            ):
                _evaluate(run, hooks)
            advance(1, _status(run, loss, step))
            if state.step < config.max_steps and _resume_point_due(hooks, state.step, last_save):
                state.seconds += time.monotonic() - last_save
                hooks.save_state()
                last_save = time.monotonic()
    state.seconds += time.monotonic() - last_save
    return state


def train_step(run: DistillRun, step: int) -> float:
    """One optimizer step over the step's global batch; the mean loss of all its windows."""
    config = run.config
    for group in run.optimizer.param_groups:
        group["lr"] = learning_rate(step, config)
    micro_batches = _micro_batches(run, step)
    total = 0.0
    for i, ids in enumerate(micro_batches):
        with _gradient_sync(run, last=i == len(micro_batches) - 1):
            loss = micro_batch_loss(run, ids) / len(micro_batches)
            loss.backward()
        total += loss.item()
    if config.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(run.parameters.values(), config.max_grad_norm)
    mask_gradients(run.parameters, run.masks)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    mask_weights(run.parameters, run.masks)
    return run.processes.mean(total)


def _gradient_sync(run: DistillRun, *, last: bool) -> Any:
    """Processes reduce their gradients on the last micro-batch of a step only."""
    if not run.processes.distributed:
        return nullcontext()
    if run.sharded:
        from llmq.distillation.sharding import set_gradient_sync

        set_gradient_sync(run.trained, last)
        return nullcontext()
    return nullcontext() if last else run.trained.no_sync()  # type: ignore[operator]


def micro_batch_loss(run: DistillRun, ids: Tensor) -> Tensor:
    config = run.config
    hidden = bool(config.hidden_weight)
    with _autocast(run.device):
        teacher_out = None
        if run.teacher is not None:
            with torch.no_grad():
                teacher_out = run.teacher(input_ids=ids, use_cache=False, output_hidden_states=hidden)  # fmt: skip
        student_out = run.trained(input_ids=ids, use_cache=False, output_hidden_states=hidden)
    pairs = None
    if hidden and teacher_out is not None:
        pairs = (
            [student_out.hidden_states[s + 1] for s, _ in run.layer_pairs],
            [teacher_out.hidden_states[t + 1] for _, t in run.layer_pairs],
        )
    teacher_logits = None if teacher_out is None else teacher_out.logits
    return distillation_loss(config, ids, student_out.logits, teacher_logits, pairs)


@torch.no_grad()
def heldout_perplexity(run: DistillRun) -> float:
    """The student's token perplexity on the held-out windows (the protocol of `llmq eval`:
    each window's next-token losses, float32), split over the processes."""
    run.student.eval()
    world = run.processes.world_size
    mine = run.eval_ids[run.processes.rank :: world]
    totals = torch.zeros(2, dtype=torch.float64)
    batches = list(mine.split(run.config.batch_size))
    for ids in batches:
        ids = ids.to(run.device)
        with _autocast(run.device):
            logits = run.student(input_ids=ids, use_cache=False).logits
        for row in range(ids.shape[0]):  # one window at a time, as `llmq eval`
            nll = F.cross_entropy(logits[row, :-1].float(), ids[row, 1:], reduction="sum")
            totals += torch.tensor([float(nll.double()), ids.shape[1] - 1], dtype=torch.float64)
    if run.sharded:  # every forward gathers layers from all processes: all run as many
        most = math.ceil(math.ceil(len(run.eval_ids) / world) / run.config.batch_size)
        for _ in range(most - len(batches)):
            with _autocast(run.device):
                run.student(input_ids=run.eval_ids[:1].to(run.device), use_cache=False)
    run.student.train()
    nll, count = run.processes.sum(totals).tolist()
    return math.exp(nll / count)


def _prune(run: DistillRun, step: int) -> None:
    """GMP: prune to the schedule's sparsity at its pruning steps, and log the target."""
    from llmq.distillation.gmp import is_pruning_step, prune_step, scheduled_sparsity

    if is_pruning_step(step, run.config):
        norms = run.input_norms
        if norms is not None:
            if norms.empty:  # no training input seen since the start: measure this batch
                _forward_without_gradients(run, step)
            norms.reduce(run.processes.sum)
        prune_step(run.student, run.masks, step, run.config, norms)
        if norms is not None:
            norms.reset()
    run.state.sparsity.append(scheduled_sparsity(step, run.config))


@torch.no_grad()
def _forward_without_gradients(run: DistillRun, step: int) -> None:
    """The student's forward pass over this process's windows of `step`, in training mode (so
    that forward hooks count it), with no gradient and no update."""
    for ids in _micro_batches(run, step):
        with _autocast(run.device):
            run.student(input_ids=ids, use_cache=False)


def _micro_batches(run: DistillRun, step: int) -> tuple[Tensor, ...]:
    """This process's windows of `step`, on its device, in forward passes of batch_size."""
    windows = run.order.batch(step, run.processes.rank, run.processes.world_size)
    return windows.to(run.device).split(run.config.batch_size)


def _evaluate(run: DistillRun, hooks: Hooks) -> None:
    if run.state.record_eval(heldout_perplexity(run)) and run.config.keep == "best":
        hooks.save_best()


def _resume_point_due(hooks: Hooks, step: int, last_save: float) -> bool:
    if hooks.checkpoint_every is not None:
        return step % hooks.checkpoint_every == 0
    return time.monotonic() - last_save >= hooks.checkpoint_every_s


def _status(run: DistillRun, loss: float, step: int) -> str:
    state = run.state
    ppl = state.evals[-1]["perplexity"]
    lr = learning_rate(step, run.config)
    tokens_per_s = state.tokens / state.step_seconds
    return f"loss {loss:.4f} · lr {lr:.2e} · {tokens_per_s:,.0f} tok/s · held-out ppl {ppl:.2f}"


def _autocast(device: torch.device) -> Any:
    """bf16 autocast on a GPU (float32 master weights and losses); plain float32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()
