"""Building what `distill` trains: data, teacher and student (plain, wrapped in DDP, or sharded
by FSDP), optimizer, masks and the state a resumed run continues from; the hooks that save
resume points and best students; and the state dict finally written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmq.config import DistillConfig
from llmq.errors import InputError
from llmq.progress import Progress

SHARDINGS = ("ddp", "fsdp")

log = logging.getLogger(__name__)


def prepare_run(
    teacher: Any,
    student: Any,
    staging: Path,
    config: DistillConfig,
    processes: Any,
    device: Any,
    resume: bool,
    sharding: str,
    progress: Progress,
) -> tuple[Any, dict[str, Any]]:
    """The run and its resume fingerprint: data, models, optimizer, masks and (with `resume`)
    the state to continue from."""
    from llmq.calib.data import evaluation_windows, training_windows
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.distillation.data import BatchOrder
    from llmq.distillation.loop import DistillRun
    from llmq.distillation.loss import layer_pairs
    from llmq.distillation.models import kept_layers
    from llmq.distillation.state import TrainState, load_state

    tokenizer = load_tokenizer(student.path)
    with progress.stage(f"tokenizing {config.train_text} and {config.eval_text}"):
        train_windows = training_windows(tokenizer, config.train_text, seq_len=config.seq_len)
        eval_windows = evaluation_windows(
            tokenizer, config.eval_text, seq_len=config.eval_seq_len,
            max_windows=config.eval_windows,
        )  # fmt: skip
    teacher_model, student_model = _models(teacher, student, staging, config, device, progress)
    sharded = processes.distributed and sharding == "fsdp"
    trained, parameters, masks = _parallel(student_model, teacher_model, student, processes, sharded)  # fmt: skip
    optimizer = torch.optim.AdamW(parameters.values(), lr=config.lr, weight_decay=config.weight_decay)  # fmt: skip
    fingerprint = {
        "config": config.model_dump(mode="json"),
        "teacher": teacher.file_stamps(),
        "student": student.file_stamps(),
        "processes": processes.world_size,
        "sharding": sharding if processes.distributed else None,
    }
    norms = _input_norms(student_model, config)
    state = None
    if resume:
        buffers = None if norms is None else norms.squares
        state = load_state(
            staging, parameters, optimizer, fingerprint, buffers, rank=processes.rank,
            sharded=student_model if sharded else None,
        )  # fmt: skip
        if processes.is_main and state is None:
            log.warning("no interrupted run to resume; starting from the first step")
        elif processes.is_main:
            log.info("resuming from step %d of %d (the last resume point)", state.step, config.max_steps)  # fmt: skip
    if state is not None and config.gmp is not None:
        from llmq.distillation.gmp import masks_from_zeros

        masks.update(masks_from_zeros(student_model, state.step, config))
    global_batch = config.batch_size * config.grad_accum * processes.world_size
    pairs = layer_pairs(student.num_layers, teacher.num_layers, kept_layers(student, teacher.num_layers))  # fmt: skip
    run = DistillRun(
        config=config, teacher=teacher_model, student=student_model, trained=trained,
        optimizer=optimizer, order=BatchOrder(train_windows.input_ids, global_batch, config.seed),
        eval_ids=eval_windows.input_ids, parameters=parameters, masks=masks,
        layer_pairs=pairs, processes=processes, device=device, state=state or TrainState(),
        input_norms=norms, sharded=sharded,
    )  # fmt: skip
    return run, fingerprint


def _models(
    teacher: Any,
    student: Any,
    staging: Path,
    config: DistillConfig,
    device: Any,
    progress: Progress,
) -> tuple[nn.Module | None, nn.Module]:
    """The teacher (bf16 on a GPU, frozen; None for loss ce) and the float32 student, with
    QAT's fake quantization and start."""
    from llmq.distillation.models import load_model

    with progress.stage("loading teacher and student"):
        teacher_model = None
        if config.uses_teacher:
            teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            teacher_model = load_model(teacher, device, teacher_dtype).eval().requires_grad_(False)
        student_model = load_model(student, device, torch.float32).train()
    if config.qat is not None:
        from llmq.distillation.qat import apply_qat, linear_args, load_start, start_folder

        apply_qat(student_model, linear_args(student, config.qat.scheme, config.qat.group_size))
        if config.qat.init != "float":  # a resumed run's state replaces these weights later
            load_start(student_model, start_folder(staging))
    check_pattern(student_model, config)
    return teacher_model, student_model


def _parallel(
    student_model: nn.Module, teacher_model: nn.Module | None, student: Any, processes: Any, sharded: bool
) -> tuple[nn.Module, dict[str, nn.Parameter], dict[str, Tensor]]:  # fmt: skip
    """What the forward pass calls (the student, DDP around it, or the student sharded in
    place with the teacher), the parameters to train and the pruning masks of the rows each
    process holds."""
    from llmq.distillation.masks import pruning_masks
    from llmq.distillation.state import parameters_of
    from llmq.io.checkpoint import recorded_sparsity

    recorded = recorded_sparsity(student.path) is not None
    masks = pruning_masks(student_model, recorded=recorded)  # whole weights, before sharding
    if sharded:
        from llmq.distillation.sharding import local_masks, shard

        shard(student_model, student.layout.layers)
        if teacher_model is not None:
            shard(teacher_model, student.layout.layers)
        parameters = parameters_of(student_model)
        return student_model, parameters, local_masks(masks, parameters)
    trained = student_model
    if processes.distributed:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(student_model)
    return trained, parameters_of(student_model), masks


def _input_norms(model: nn.Module, config: DistillConfig) -> Any:
    """GMP by Wanda's metric counts the inputs of every prunable linear while training."""
    if config.gmp is None or config.gmp.method != "wanda":
        return None
    from llmq.distillation.gmp import InputNorms

    return InputNorms(model)


def run_hooks(
    run: Any,
    staging: Path,
    fingerprint: dict[str, Any],
    checkpoint_every: int | None,
    resume_every_s: float,
) -> Any:
    """Resume points and best students; every process calls them, the first one writes (under
    FSDP each process also writes its own shards, and all gather the best student)."""
    from llmq.distillation.loop import Hooks
    from llmq.distillation.sharding import full_state
    from llmq.distillation.state import save_best, save_best_state, save_state

    processes = run.processes

    def state() -> None:
        norms = None if run.input_norms is None else run.input_norms.state()
        save_state(
            staging, run.state, run.parameters, run.optimizer, fingerprint, norms,
            processes=processes, sharded=run.student if run.sharded else None,
        )  # fmt: skip
        processes.barrier()

    def best() -> None:
        if run.sharded:
            whole = full_state(run.student)  # every process takes part in the gathering
            if processes.is_main:
                save_best_state(staging, whole)
        elif processes.is_main:
            save_best(staging, run.parameters)

    return Hooks(state, best, checkpoint_every, resume_every_s)


def final_student(run: Any, staging: Path) -> tuple[int, dict[str, Tensor]]:
    """Which step's student is written (the best one, or the last) and its state dict (whole on
    the first process; every process must call this). Under FSDP the last student is gathered
    from the shards, a best one read back from its file."""
    from llmq.distillation.sharding import full_state
    from llmq.distillation.state import load_best, load_best_state

    state = run.state
    kept = state.step if run.config.keep == "last" or state.best_step == state.step else int(state.best_step)  # fmt: skip
    if run.sharded:
        if kept == state.step:  # every process takes part in the gathering
            return kept, full_state(run.student)
        return kept, load_best_state(staging) if run.processes.is_main else {}
    if kept != state.step:
        load_best(staging, run.parameters)
    return kept, run.student.state_dict()


def check_pattern(model: nn.Module, config: DistillConfig) -> None:
    """GMP's N:M groups must tile every linear's inputs."""
    from llmq.distillation.masks import prunable_linears

    pattern = config.gmp.nm_pattern if config.gmp else None
    if pattern is None:
        return
    for name, linear in prunable_linears(model).items():
        if linear.in_features % pattern[1]:
            module = name.removesuffix(".weight")
            raise InputError(
                f"--pattern {pattern[0]}:{pattern[1]}: {pattern[1]} does not divide the {linear.in_features} inputs of {module}",
                hint="choose an M that divides every linear's in_features (4 and 8 usually do)",
            )


def linear_sparsity(run: Any) -> float:
    """The share of zeros in the student's decoder linears (their rows summed over the
    processes when sharded)."""
    from llmq.distillation.masks import prunable_linears
    from llmq.distillation.sharding import local

    weights = [local(linear.weight.data) for linear in prunable_linears(run.student).values()]
    zeros, total = sum(int((w == 0).sum()) for w in weights), sum(w.numel() for w in weights)
    if run.sharded:
        zeros, total = run.processes.sum(torch.tensor([zeros, total], dtype=torch.float64)).tolist()  # fmt: skip
    return zeros / total
