"""`train`: a student (usually a pruned copy of the teacher) trained on the teacher's token
distributions and written as a plain checkpoint; resumable, one process or many (torchrun).
What `distill` runs, and a recipe's distill stage; iterative pruning runs it once a round."""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from llmq.api.common import _open
from llmq.config import DistillConfig, build
from llmq.config.distill import DISTILL_RESUME_EVERY_S, ITERATIVE_ROUNDS
from llmq.errors import InputError
from llmq.progress import NO_PROGRESS, Progress


@dataclass(slots=True)
class DistillResult:
    out_dir: Path
    teacher: str
    student: str
    config: dict[str, Any]
    steps: int
    tokens: int  # training tokens seen, all processes together
    epochs: float  # passes over the training windows
    seconds: float  # wall time of training and evaluations, interrupted runs included
    tokens_per_s: float  # in the training steps alone
    kept_step: int  # the step whose student was written (the best one, or the last)
    evaluations: list[dict[str, float]]  # held-out perplexity during training
    losses: list[float]  # mean loss of every step
    masked_linears: int  # pruned linears whose zeros were kept
    processes: int
    sparsity: float | None = None  # GMP: the share of zeros in the decoder's linears written
    sparsity_schedule: list[float] = field(default_factory=list)  # GMP: the target each step
    rounds: list[dict[str, Any]] = field(default_factory=list)  # iterative: each round's report
    perplexity: dict[str, Any] = field(default_factory=dict)  # teacher, before, after, recovery

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out_dir": str(self.out_dir)}


def train(
    teacher: str | Path,
    student: str | Path,
    out: str | Path,
    *,
    config: DistillConfig | None = None,
    max_tokens: int | None = None,
    checkpoint_every: int | None = None,
    resume_every_s: float = DISTILL_RESUME_EVERY_S,
    resume: bool = False,
    overwrite: bool = False,
    reference: bool = True,
    space_check: bool = True,
    sharding: str = "ddp",
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    **options: Any,
) -> DistillResult:
    """Distill TEACHER into STUDENT (both float checkpoints or built-in names, sharing a
    vocabulary) and write the trained student at OUT, shaped and typed like STUDENT.

    `config` (or its fields as keyword `options`; `max_tokens` in place of `max_steps`) says
    how. Run under `torchrun` it trains data-parallel, each process on its slice of every
    batch, with the student replicated (`sharding` "ddp") or the student, its optimizer state
    and the teacher sharded over the processes ("fsdp": FSDP2). A resume point is saved every `checkpoint_every` steps (else every
    `resume_every_s` seconds) in OUT's staging folder; `resume=True` continues from it to the
    result an uninterrupted run gives. `prune="iterative"` runs rounds of stages: `distill`."""
    import torch

    from llmq.calib.stream import resolve_device
    from llmq.processes import join_processes, leave_processes, process_device

    teacher_ckpt, student_ckpt = _open(teacher, progress), _open(student, progress)
    check_models(teacher_ckpt, student_ckpt)
    run_device = resolve_device(device)
    processes = join_processes(run_device)
    try:
        run_device = process_device(run_device, processes)
        config = config or distill_config(options, max_tokens, processes.world_size)
        check_run(config, checkpoint_every, resume_every_s, processes.world_size, sharding)
        if config.iterative is not None:
            raise InputError("prune iterative: runs its own rounds of prune and distill stages", hint="use `llmq distill --prune iterative`, or write the rounds as stages")  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            return _distill(
                teacher_ckpt, student_ckpt, Path(out), config, processes, run_device,
                checkpoint_every=checkpoint_every, resume_every_s=resume_every_s,
                resume=resume, overwrite=overwrite, reference=reference,
                space_check=space_check, sharding=sharding,
                progress=progress if processes.is_main else NO_PROGRESS,
            )  # fmt: skip
    finally:
        leave_processes(processes)


def check_models(teacher: Any, student: Any) -> None:
    from llmq.distillation.models import check_same_vocabulary, check_trainable

    check_trainable(teacher, "teacher")
    check_trainable(student, "student")
    check_same_vocabulary(teacher, student)


def distill_config(
    options: dict[str, Any], max_tokens: int | None, world_size: int
) -> DistillConfig:
    """The config from keyword options, `max_tokens` (or iterative pruning's
    `steps_per_round`) turned into optimizer steps."""
    options = _steps_per_round(dict(options))
    if max_tokens is not None:
        if options.get("max_steps") is not None:
            raise InputError("give --max-steps or --max-tokens, not both")
        if max_tokens < 1:
            raise InputError(f"--max-tokens {max_tokens}: must be >= 1")
        sizes = {k: v for k, v in options.items() if k in ("seq_len", "batch_size", "grad_accum")}
        probe = build(DistillConfig, max_steps=1, **sizes)
        assert isinstance(probe, DistillConfig)
        per_step = probe.seq_len * probe.batch_size * probe.grad_accum * world_size
        steps = math.ceil(max_tokens / per_step)
        rounds = _rounds(options)
        if rounds is not None:  # whole rounds
            steps = math.ceil(steps / rounds) * rounds
        options = {**options, "max_steps": steps}
    if options.get("max_steps") is None:
        raise InputError("how long to train: give --max-steps or --max-tokens")
    config = build(DistillConfig, **options)  # None is meaningful: max_grad_norm None, no clipping
    assert isinstance(config, DistillConfig)
    return config


def _steps_per_round(options: dict[str, Any]) -> dict[str, Any]:
    """`steps_per_round` N of iterative pruning is `max_steps` N x rounds."""
    per_round = options.pop("steps_per_round", None)
    if per_round is None:
        return options
    rounds = _rounds(options)
    if rounds is None:
        raise InputError("--steps-per-round: goes with --prune iterative")
    if options.get("max_steps") is not None:
        raise InputError("give --steps-per-round or --max-steps, not both")
    if per_round < 1:
        raise InputError(f"--steps-per-round {per_round}: must be >= 1")
    return {**options, "max_steps": per_round * rounds}


def _rounds(options: dict[str, Any]) -> int | None:
    """Iterative pruning's rounds (None: no iterative pruning), from its config or its keys."""
    iterative = options.get("iterative")
    if isinstance(iterative, dict):
        return int(iterative.get("rounds", ITERATIVE_ROUNDS))
    return None if iterative is None else iterative.rounds


def check_run(
    config: DistillConfig,
    checkpoint_every: int | None,
    resume_every_s: float,
    world_size: int,
    sharding: str,
) -> None:
    from llmq.distillation.build import SHARDINGS

    if sharding not in SHARDINGS:
        raise InputError(f"--sharding {sharding!r}: not a way to spread the models", hint=f"choose one of: {', '.join(SHARDINGS)}")  # fmt: skip
    if sharding == "fsdp" and world_size == 1:
        raise InputError("--sharding fsdp: shards over torchrun's processes; this run has one", hint="torchrun --nproc-per-node N -m llmq distill ...")  # fmt: skip
    if checkpoint_every is not None and checkpoint_every < 1:
        raise InputError(f"--checkpoint-every {checkpoint_every}: must be >= 1 step")
    if not resume_every_s > 0:
        raise InputError(f"--resume-every {resume_every_s}: must be > 0 seconds")
    if world_size > 1 and config.iterative is not None:
        raise InputError("--prune iterative: runs in one process (its one-shot pruning is not data-parallel)")  # fmt: skip
    if world_size > 1 and config.eval_windows < world_size:
        raise InputError(f"--eval-windows {config.eval_windows}: fewer than the {world_size} processes")  # fmt: skip


def _distill(
    teacher: Any,
    student: Any,
    out: Path,
    config: DistillConfig,
    processes: Any,
    device: Any,
    *,
    checkpoint_every: int | None,
    resume_every_s: float,
    resume: bool,
    overwrite: bool,
    reference: bool,
    space_check: bool,
    sharding: str,
    progress: Progress,
) -> DistillResult:
    from contextlib import nullcontext

    from llmq.distillation.build import final_student, prepare_run, run_hooks
    from llmq.io.atomic import check_output_dir, claim_output, staging_path
    from llmq.io.space import check_free_space

    staging = staging_path(out)
    kept = partial(_keep_if_resumable, staging)
    inputs = distill_inputs(teacher, student, config)
    claim = claim_output(out, inputs=inputs, kept=kept) if processes.is_main else nullcontext()
    with claim:
        if processes.is_main:
            check_output_dir(out, overwrite=overwrite)
            if space_check:
                check_free_space(out, _disk_needed(student))
            if not resume:
                shutil.rmtree(staging, ignore_errors=True)
            _qat_start(config, student, staging, progress, device)
        processes.barrier()  # the other processes read what the first one prepared
        run, fingerprint = prepare_run(teacher, student, staging, config, processes, device, resume, sharding, progress)  # fmt: skip
        hooks = run_hooks(run, staging, fingerprint, checkpoint_every, resume_every_s)
        try:
            from llmq.distillation.loop import train

            train(run, hooks, progress)
        except BaseException:
            if processes.is_main and not (staging / ".distill" / "latest").is_file():
                shutil.rmtree(staging, ignore_errors=True)
            raise
        kept_step, written = final_student(run, staging)
        result = _result(run, teacher, student, out, kept_step)
        if processes.is_main:
            from llmq.distillation.output import write_result

            write_result(run, written, student, staging, out, result.to_dict(), device, reference, progress)  # fmt: skip
        processes.barrier()
    return result


def distill_inputs(teacher: Any, student: Any, config: DistillConfig) -> list[tuple[str, Any]]:
    """What a distillation reads, as inputs no output may cover: both models, the texts."""
    from llmq.texts import text_inputs

    texts = text_inputs(config.train_text, "training text") + text_inputs(config.eval_text, "held-out text")  # fmt: skip
    return [("teacher", teacher.path), ("student", student.path), *texts]


def _qat_start(config: DistillConfig, student: Any, staging: Path, progress: Progress, device: Any) -> None:  # fmt: skip
    """`qat_init gptq|awq`: that method's solution for the student, computed once (a resumed run keeps
    it), removed when the run is written."""
    qat = config.qat
    if qat is None or qat.init == "float":
        return
    from llmq.distillation.qat import ptq_start, start_folder

    ptq_start(student.path, start_folder(staging), qat.init, qat.scheme, qat.group_size, progress, str(device))  # fmt: skip


def _result(run: Any, teacher: Any, student: Any, out: Path, kept_step: int) -> DistillResult:
    from llmq.distillation.build import linear_sparsity

    state = run.state
    return DistillResult(
        out_dir=out, teacher=str(teacher.path), student=str(student.path),
        config=run.config.model_dump(mode="json"), steps=state.step, tokens=state.tokens,
        epochs=round(run.order.epochs(state.step), 3), seconds=round(state.seconds, 3),
        tokens_per_s=state.tokens / state.step_seconds if state.step_seconds else 0.0,
        kept_step=kept_step, evaluations=state.evals, losses=state.losses,
        masked_linears=len(run.masks), processes=run.processes.world_size,
        sparsity=linear_sparsity(run) if run.config.gmp is not None else None,
        sparsity_schedule=state.sparsity,
    )  # fmt: skip


def _keep_if_resumable(staging: Path) -> str | None:
    from llmq.distillation.state import has_resume_point

    if has_resume_point(staging):
        return f"training state kept in {staging}: rerun the same command with --resume"
    shutil.rmtree(staging, ignore_errors=True)
    return None


def _disk_needed(student: Any) -> int:
    """The output, plus a resume point at its peak: the new one (student and AdamW's two
    moments, float32) written before the old one goes, and the best student."""
    from llmq.pipeline.output import weights_size

    params = sum(math.prod(info.shape) for info in student.tensors.values())
    return weights_size(student.path) + params * 4 * (2 * 3 + 1)
