"""`llmq distill`: train a student on a teacher's token distributions, write it as a plain
checkpoint. Under `torchrun` it trains data-parallel."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from llmq.cli.console import (
    cli_errors,
    out_console,
    print_json,
    progress_bars,
    quiet_libraries,
    resume_hint_on_interrupt,
)
from llmq.cli.options import (
    OUTPUT,
    PRUNING,
    RUN,
    Device,
    JsonFlag,
    Overwrite,
    Reference,
    Resume,
    SpaceCheck,
)
from llmq.config.distill import DISTILL_RESUME_EVERY_S, ITERATIVE_ROUNDS
from llmq.texts import DEFAULT_CALIBRATION_TEXT, DEFAULT_EVAL_TEXT

MODELS, LOSS, TRAINING, EVALUATION, QAT = "Models", "Loss", "Training", "Evaluation", "Quantization"


def distill(
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
    ] = "forward-kl",
    temperature: Annotated[
        float,
        typer.Option(
            metavar="T",
            help="Softens both distributions; the KL is scaled by T².",
            rich_help_panel=LOSS,
        ),
    ] = 1.0,
    ce_weight: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="Weight of the next-token cross-entropy added to a KL loss.",
            rich_help_panel=LOSS,
        ),
    ] = 0.0,
    hidden_weight: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="Weight of a 1 - cos loss between matched layers' hidden states.",
            rich_help_panel=LOSS,
        ),
    ] = 0.0,
    data: Annotated[
        str,
        typer.Option(
            metavar="TEXT",
            help="Training text: shakespeare, pydoc, news (join with +), a file or a cached "
            "dataset.",
            rich_help_panel=TRAINING,
        ),
    ] = DEFAULT_CALIBRATION_TEXT,
    seq_len: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Tokens per training window.",
            rich_help_panel=TRAINING,
        ),
    ] = 512,
    batch_size: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Windows per forward pass, per process.",
            rich_help_panel=TRAINING,
        ),
    ] = 1,
    grad_accum: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Forward passes per optimizer step.",
            rich_help_panel=TRAINING,
        ),
    ] = 8,
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
    ] = 1e-4,
    warmup_steps: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Steps of linear warm-up before the cosine decay.",
            rich_help_panel=TRAINING,
        ),
    ] = 0,
    min_lr_ratio: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="The cosine ends at this share of --lr.",
            rich_help_panel=TRAINING,
        ),
    ] = 0.1,
    weight_decay: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="AdamW's decoupled weight decay.",
            rich_help_panel=TRAINING,
        ),
    ] = 0.0,
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
    ] = 0,
    eval_text: Annotated[
        str,
        typer.Option(
            metavar="TEXT",
            help="Held-out text scored during training (never the training data).",
            rich_help_panel=EVALUATION,
        ),
    ] = DEFAULT_EVAL_TEXT,
    eval_windows: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Held-out windows of 512 tokens scored at each evaluation.",
            rich_help_panel=EVALUATION,
        ),
    ] = 16,
    eval_every: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Steps between held-out evaluations; 0: at the start and the end only.",
            rich_help_panel=EVALUATION,
        ),
    ] = 0,
    keep: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="Which student to write: best (lowest held-out perplexity) or last.",
            rich_help_panel=EVALUATION,
        ),
    ] = "best",
    prune: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="none, gmp (gradually while training) or iterative (prune, distill, repeat).",
            rich_help_panel=PRUNING,
        ),
    ] = "none",
    prune_method: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="Scores weights: magnitude, wanda, or (iterative only) sparsegpt or structured.",
            rich_help_panel=PRUNING,
        ),
    ] = "magnitude",
    sparsity: Annotated[
        float | None,
        typer.Option(
            metavar="X",
            help="The final share of each row's weights removed; --sparsity or --pattern (not "
            "both).",
            rich_help_panel=PRUNING,
        ),
    ] = None,
    pattern: Annotated[
        str | None,
        typer.Option(
            metavar="N:M",
            help="--prune gmp: an N:M pattern to reach (2:4); --sparsity or --pattern (not both).",
            rich_help_panel=PRUNING,
        ),
    ] = None,
    prune_start: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="--prune gmp: the step pruning starts at.",
            rich_help_panel=PRUNING,
        ),
    ] = 0,
    prune_end: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="--prune gmp: the step the final sparsity is reached at (default: 3/4 of them).",
            rich_help_panel=PRUNING,
        ),
    ] = None,
    prune_every: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="--prune gmp: steps between mask updates.",
            rich_help_panel=PRUNING,
        ),
    ] = 1,
    rounds: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="--prune iterative: prune-then-distill rounds.",
            rich_help_panel=PRUNING,
        ),
    ] = ITERATIVE_ROUNDS,
    round_schedule: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="--prune iterative: the sparsity after each round, cubic or geometric.",
            rich_help_panel=PRUNING,
        ),
    ] = "cubic",
    steps_per_round: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="--prune iterative: training steps after each pruning (default: --max-steps "
            "split).",
            rich_help_panel=PRUNING,
        ),
    ] = None,
    qat: Annotated[
        str | None,
        typer.Option(
            metavar="SCHEME",
            help="Train fake-quantized and write this scheme: w4a16, w4a16-asym, w8a16, w8a8 or "
            "fp8.",
            rich_help_panel=QAT,
        ),
    ] = None,
    qat_group_size: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="--qat: the group size, or -1 per output channel (default: the scheme's).",
            rich_help_panel=QAT,
        ),
    ] = None,
    qat_init: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="--qat: start from the float weights (float) or a gptq or awq solution.",
            rich_help_panel=QAT,
        ),
    ] = "float",
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
            data=data, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
            max_steps=max_steps, lr=lr, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm or None, seed=seed,
            eval_text=eval_text, eval_windows=eval_windows, eval_every=eval_every, keep=keep,
            prune=prune, prune_method=prune_method, sparsity=sparsity, pattern=pattern,
            prune_start=prune_start, prune_end=prune_end, prune_every=prune_every, rounds=rounds,
            round_schedule=round_schedule, steps_per_round=steps_per_round, qat=qat,
            qat_group_size=qat_group_size, qat_init=qat_init,
        )  # fmt: skip
    if not main_process:
        return
    print_json(result.to_dict()) if json_out else render(result)


def render(result: Any) -> None:
    table = Table(title=f"distillation of {Path(result.student).name} from {Path(result.teacher).name}")  # fmt: skip
    table.add_column("what")
    table.add_column("value", justify="right")
    config = result.config
    table.add_row("loss", config["loss"] + (f", T {config['temperature']}" if config["loss"] != "ce" else ""))  # fmt: skip
    table.add_row("steps", f"{result.steps} ({result.tokens:,} tokens, {result.epochs:.2f} epochs)")
    table.add_row("speed", f"{result.tokens_per_s:,.0f} tokens/s on {result.processes} process(es)")  # fmt: skip
    first, kept = result.evaluations[0], _eval_at(result, result.kept_step)
    table.add_row(
        f"held-out ppl ({config['eval_text']}, {config['eval_windows']} windows)",
        f"{first['perplexity']:.3f} -> {kept['perplexity']:.3f} (step {result.kept_step})",
    )
    if result.masked_linears:
        table.add_row("pruned linears kept sparse", str(result.masked_linears))
    if result.sparsity is not None:
        table.add_row(f"sparsity of the decoder's linears ({config['prune']})", f"{result.sparsity:.1%}")  # fmt: skip
    for r in result.rounds:
        reached = f"{r['sparsity']:.1%}" if "sparsity" in r else f"{r['parameters']:,} parameters"
        table.add_row(
            f"round {r['round']}: pruned to, held-out ppl pruned -> distilled",
            f"{reached}, {r['perplexity_pruned']:.3f} -> {r['perplexity_kept']:.3f}",
        )
    if result.perplexity:
        ppl = result.perplexity
        table.add_row("perplexity: teacher", f"{ppl['teacher']:.3f}")
        table.add_row("perplexity: student before -> after", f"{ppl['before']:.3f} -> {ppl['after']:.3f}")  # fmt: skip
        if ppl["recovery"] is not None:
            table.add_row("gap to the teacher recovered", f"{ppl['recovery']:.1%}")
    out_console.print(table)
    if result.perplexity:
        p = result.perplexity["protocol"]
        out_console.print(
            f"perplexity protocol: {p['text']}, {p['windows']} x {p['seq_len']} tokens, BOS {'yes' if p['bos'] else 'no'}, {p['dtype']}"
        )
    out_console.print(f"wrote {result.out_dir} after {result.seconds:.1f} s of training")


def _eval_at(result: Any, step: int) -> dict[str, float]:
    return next(e for e in reversed(result.evaluations) if e["step"] == step)
