"""`llmq distill`: train a student on a teacher's token distributions, write it as a plain
checkpoint. Under `torchrun` it trains data-parallel."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from llmq.cli.console import (
    cli_errors,
    print_json,
    progress_bars,
    quiet_libraries,
    resume_hint_on_interrupt,
)
from llmq.cli.distill_flags import (
    PatternFlag,
    PruneEndFlag,
    PruneEveryFlag,
    PruneFlag,
    PruneMethodFlag,
    PruneStartFlag,
    QatFlag,
    QatGroupSizeFlag,
    QatInitFlag,
    RoundScheduleFlag,
    RoundsFlag,
    SparsityFlag,
    StepsPerRoundFlag,
    sub_configs,
)
from llmq.cli.distill_report import render
from llmq.cli.options import (
    OUTPUT,
    RUN,
    Device,
    JsonFlag,
    Overwrite,
    Reference,
    Resume,
    SpaceCheck,
    defaults,
    explicit,
    fraction,
    renamed,
)
from llmq.config.distill import (
    DISTILL_RESUME_EVERY_S,
    DistillConfig,
    GmpConfig,
    IterativeConfig,
    QatConfig,
)

MODELS, LOSS, TRAINING, EVALUATION = "Models", "Loss", "Training", "Evaluation"
D, GMP, ITER, QAT_DEFAULTS = (defaults(kind) for kind in (DistillConfig, GmpConfig, IterativeConfig, QatConfig))  # fmt: skip


def distill(
    ctx: typer.Context,
    teacher: Annotated[
        str,
        typer.Option(
            metavar="MODEL",
            help="The model to learn from: a float checkpoint folder or a built-in name.",
            rich_help_panel=MODELS,
        ),
    ],
    student: Annotated[
        str,
        typer.Option(
            metavar="MODEL",
            help="The model to train (often a pruned teacher), with the teacher's tokenizer.",
            rich_help_panel=MODELS,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output folder: the trained student; must not exist unless --overwrite.",
            rich_help_panel=OUTPUT,
        ),
    ],
    loss: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="forward-kl, reverse-kl (mode-seeking) or ce (plain cross-entropy, no teacher).",
            rich_help_panel=LOSS,
        ),
    ] = D["loss"],
    temperature: Annotated[
        float,
        typer.Option(
            metavar="T",
            help="Softens both distributions; the KL is scaled by T².",
            rich_help_panel=LOSS,
        ),
    ] = D["temperature"],
    ce_weight: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="Weight of the next-token cross-entropy added to a KL loss.",
            rich_help_panel=LOSS,
        ),
    ] = D["ce_weight"],
    hidden_weight: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="Weight of a 1 - cos loss between matched layers' hidden states.",
            rich_help_panel=LOSS,
        ),
    ] = D["hidden_weight"],
    train_text: Annotated[
        str,
        typer.Option(
            *renamed("--train-text", "--data"),
            metavar="TEXT",
            help="Training text: shakespeare, pydoc, news (join with +), a file or a cached "
            "dataset.",
            rich_help_panel=TRAINING,
        ),
    ] = D["train_text"],
    seq_len: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Tokens per training window.",
            rich_help_panel=TRAINING,
        ),
    ] = D["seq_len"],
    batch_size: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Windows per forward pass, per process.",
            rich_help_panel=TRAINING,
        ),
    ] = D["batch_size"],
    grad_accum: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Forward passes per optimizer step.",
            rich_help_panel=TRAINING,
        ),
    ] = D["grad_accum"],
    max_steps: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Optimizer steps to train.",
            rich_help_panel=TRAINING,
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Or: training tokens, turned into whole optimizer steps.",
            rich_help_panel=TRAINING,
        ),
    ] = None,
    lr: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="Peak learning rate of AdamW.",
            rich_help_panel=TRAINING,
        ),
    ] = D["lr"],
    warmup_steps: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Steps of linear warm-up before the cosine decay.",
            rich_help_panel=TRAINING,
        ),
    ] = D["warmup_steps"],
    min_lr_ratio: Annotated[
        float,
        typer.Option(
            metavar="X",
            parser=fraction("--min-lr-ratio"),
            help="The cosine ends at this share of --lr.",
            rich_help_panel=TRAINING,
        ),
    ] = D["min_lr_ratio"],
    weight_decay: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="AdamW's decoupled weight decay.",
            rich_help_panel=TRAINING,
        ),
    ] = D["weight_decay"],
    max_grad_norm: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="Clip the gradient's global norm to this; 0: no clipping.",
            rich_help_panel=TRAINING,
        ),
    ] = 1.0,
    seed: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Seed of the data order (and anything random).",
            rich_help_panel=TRAINING,
        ),
    ] = D["seed"],
    eval_text: Annotated[
        str,
        typer.Option(
            metavar="TEXT",
            help="Held-out text scored during training (never the training data).",
            rich_help_panel=EVALUATION,
        ),
    ] = D["eval_text"],
    eval_windows: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Held-out windows scored at each evaluation.",
            rich_help_panel=EVALUATION,
        ),
    ] = D["eval_windows"],
    eval_seq_len: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Tokens per held-out window.",
            rich_help_panel=EVALUATION,
        ),
    ] = D["eval_seq_len"],
    eval_every: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Steps between held-out evaluations; 0: at the start and the end only.",
            rich_help_panel=EVALUATION,
        ),
    ] = D["eval_every"],
    keep: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="Which student to write: best (lowest held-out perplexity) or last.",
            rich_help_panel=EVALUATION,
        ),
    ] = D["keep"],
    prune: PruneFlag = "none",
    prune_method: PruneMethodFlag = "magnitude",
    sparsity: SparsityFlag = None,
    pattern: PatternFlag = None,
    prune_start: PruneStartFlag = GMP["start"],
    prune_end: PruneEndFlag = GMP["end"],
    prune_every: PruneEveryFlag = GMP["every"],
    rounds: RoundsFlag = ITER["rounds"],
    round_schedule: RoundScheduleFlag = ITER["schedule"],
    steps_per_round: StepsPerRoundFlag = None,
    qat: QatFlag = None,
    qat_group_size: QatGroupSizeFlag = None,
    qat_init: QatInitFlag = QAT_DEFAULTS["init"],
    checkpoint_every: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Steps between resume points (default: by time, see --resume-every).",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    resume_every: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            help="Seconds between resume points, without --checkpoint-every.",
            rich_help_panel=OUTPUT,
        ),
    ] = DISTILL_RESUME_EVERY_S,
    sharding: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="Under torchrun: ddp (replicate the models) or fsdp (shard them).",
            rich_help_panel=RUN,
        ),
    ] = "ddp",
    resume: Resume = False,
    overwrite: Overwrite = False,
    evaluate: Annotated[
        bool,
        typer.Option(
            help="Report teacher, student and result perplexity, and the share of the gap closed.",
            rich_help_panel=EVALUATION,
        ),
    ] = True,
    reference: Reference = True,
    space_check: SpaceCheck = True,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Train --student on --teacher's next-token distributions.

    The student is written back as a plain checkpoint every loader reads. The usual chain:
    llmq prune --structured makes the student, llmq distill repairs it, llmq quantize
    compresses it. Data-parallel under torchrun --nproc-per-node N -m llmq distill ...; zeros of
    a pruned student stay zero. See docs/distill.md for details.
    """
    quiet_libraries()
    from llmq import api

    main_process = os.environ.get("RANK", "0") == "0"
    with (
        cli_errors(),
        progress_bars(json_out=json_out or not main_process) as progress,
        resume_hint_on_interrupt(out),
    ):
        result = api.distill(
            teacher, student, out, max_tokens=max_tokens, checkpoint_every=checkpoint_every,
            resume_every_s=resume_every, resume=resume, overwrite=overwrite, evaluate=evaluate,
            reference=reference, space_check=space_check, sharding=sharding, progress=progress,
            device=device,
            loss=loss, temperature=temperature, ce_weight=ce_weight, hidden_weight=hidden_weight,
            train_text=train_text, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
            max_steps=max_steps, lr=lr, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm or None, seed=seed,
            eval_text=eval_text, eval_windows=eval_windows, eval_seq_len=eval_seq_len,
            eval_every=eval_every, keep=keep,
            steps_per_round=steps_per_round, **sub_configs(ctx.params, explicit(ctx)),
        )  # fmt: skip
    if not main_process:
        return
    print_json(result.to_dict()) if json_out else render(result)
