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
from llmq.cli.options import Device, JsonFlag, Overwrite, Reference, Resume, SpaceCheck
from llmq.config.distill import DISTILL_RESUME_EVERY_S, ITERATIVE_ROUNDS
from llmq.texts import DEFAULT_CALIBRATION_TEXT, DEFAULT_EVAL_TEXT


def distill(
    teacher: Annotated[
        str,
        typer.Option(help="The model to learn from: a float checkpoint folder or a built-in name."),
    ],
    student: Annotated[
        str,
        typer.Option(
            help="The model to train (usually a pruned copy of the teacher): a float checkpoint folder or built-in name with the teacher's tokenizer."
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output folder: the trained student, shaped and typed like --student; must not exist unless --overwrite.",
        ),
    ],
    loss: Annotated[
        str,
        typer.Option(
            help="forward-kl: KL(teacher ‖ student) of the next-token distributions (Minitron); reverse-kl: KL(student ‖ teacher) (mode-seeking, MiniLLM); ce: plain cross-entropy on the text without a teacher (fine-tuning, the baseline)."
        ),
    ] = "forward-kl",
    temperature: Annotated[
        float,
        typer.Option(help="Softens both distributions; the KL is scaled by T² (Hinton)."),
    ] = 1.0,
    ce_weight: Annotated[
        float, typer.Option(help="Adds this much next-token cross-entropy to a KL loss.")
    ] = 0.0,
    hidden_weight: Annotated[
        float,
        typer.Option(
            help="Adds this much 1 - cos between matched layers' hidden states (DistilBERT): the layers a depth-pruned student kept, else spread evenly."
        ),
    ] = 0.0,
    data: Annotated[
        str,
        typer.Option(
            help="Training text: shakespeare, pydoc, news (their calibration splits; joined with +), a .txt/.jsonl/.parquet file, or a dataset in the local HF cache. Packed into --seq-len windows, shuffled each epoch."
        ),
    ] = DEFAULT_CALIBRATION_TEXT,
    seq_len: Annotated[int, typer.Option(help="Tokens per training window.")] = 512,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass, per process.")] = 1,
    grad_accum: Annotated[
        int,
        typer.Option(
            help="Forward passes per optimizer step. Global batch: batch-size x grad-accum x processes windows."
        ),
    ] = 8,
    max_steps: Annotated[int | None, typer.Option(help="Optimizer steps to train.")] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(help="Or: training tokens, turned into whole optimizer steps."),
    ] = None,
    lr: Annotated[float, typer.Option(help="Peak learning rate of AdamW.")] = 1e-4,
    warmup_steps: Annotated[
        int, typer.Option(help="Steps of linear warm-up before the cosine decay.")
    ] = 0,
    min_lr_ratio: Annotated[
        float, typer.Option(help="The cosine ends at this share of --lr.")
    ] = 0.1,
    weight_decay: Annotated[float, typer.Option(help="AdamW's decoupled weight decay.")] = 0.0,
    max_grad_norm: Annotated[
        float, typer.Option(help="Clip the gradient's global norm to this; 0: no clipping.")
    ] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the data order (and anything random).")] = 0,
    eval_text: Annotated[
        str,
        typer.Option(
            help="Held-out text for the student's perplexity during training (the held-out split of a built-in; never the training data)."
        ),
    ] = DEFAULT_EVAL_TEXT,
    eval_windows: Annotated[
        int, typer.Option(help="Held-out windows of 512 tokens scored at each evaluation.")
    ] = 16,
    eval_every: Annotated[
        int,
        typer.Option(help="Steps between held-out evaluations; 0: at the start and the end only."),
    ] = 0,
    keep: Annotated[
        str,
        typer.Option(
            help="best: write the student with the lowest held-out perplexity seen; last: the final one."
        ),
    ] = "best",
    prune: Annotated[
        str,
        typer.Option(
            help="gmp: gradual pruning while training (Zhu & Gupta): the decoder linears' sparsity rises along the cubic schedule to --sparsity (or --pattern) between --prune-start and --prune-end. iterative: --rounds of one-shot `llmq prune --method PRUNE_METHOD` then distillation (--steps-per-round each), the sparsity rising by --round-schedule; perplexity after each. Pruned weights stay zero. none: no pruning."
        ),
    ] = "none",
    prune_method: Annotated[
        str,
        typer.Option(
            help="How pruning scores weights: magnitude (|w|), wanda (|w|·‖x‖; with gmp from the running norms of the training inputs since the previous mask update) sparsegpt (iterative only: the one-shot solver, which updates the remaining weights) or structured (iterative only: `llmq prune --structured --params`, whole MLP channels; --sparsity is then the share of the decoder's parameters removed)."
        ),
    ] = "magnitude",
    sparsity: Annotated[
        float | None,
        typer.Option(
            help="--prune gmp or iterative: the final share of each row's weights removed, in (0, 1)."
        ),
    ] = None,
    pattern: Annotated[
        str | None,
        typer.Option(
            help="--prune gmp: an N:M pattern to reach instead (2:4: at most 2 non-zeros in every 4 inputs); the number removed per group rises with the schedule."
        ),
    ] = None,
    prune_start: Annotated[int, typer.Option(help="--prune gmp: the step pruning starts at.")] = 0,
    prune_end: Annotated[
        int | None,
        typer.Option(
            help="--prune gmp: the step the final sparsity is reached at (default: 3/4 of the steps); training goes on with the masks fixed."
        ),
    ] = None,
    prune_every: Annotated[int, typer.Option(help="--prune gmp: steps between mask updates.")] = 1,
    rounds: Annotated[
        int, typer.Option(help="--prune iterative: prune-then-distill rounds.")
    ] = ITERATIVE_ROUNDS,
    round_schedule: Annotated[
        str,
        typer.Option(
            help="--prune iterative: the sparsity after round r of R. cubic: s(1 - (1 - r/R)^3), Zhu & Gupta's schedule, most of the pruning in the first rounds and the last one small (measured better at 70%). geometric: 1 - (1 - s)^(r/R), the same share of the remaining weights every round."
        ),
    ] = "cubic",
    steps_per_round: Annotated[
        int | None,
        typer.Option(
            help="--prune iterative: optimizer steps of distillation after each pruning (in place of --max-steps, which is split evenly over the rounds)."
        ),
    ] = None,
    qat: Annotated[
        str | None,
        typer.Option(
            help="Quantization-aware distillation: train on this scheme's fake-quantized weights (w4a16, w4a16-asym, w8a16, w8a8, fp8; straight-through gradients, scales recomputed from the weights each step; w8a8 and fp8 also quantize each linear's input per token, as the checkpoint runs) and write OUT as that scheme's compressed-tensors checkpoint, whose codes reproduce the trained forward exactly."
        ),
    ] = None,
    qat_group_size: Annotated[
        int | None,
        typer.Option(
            help="--qat: the group size, or -1 for one scale per output channel (default the scheme's, with `llmq quantize`'s fallback where it does not divide a layer)."
        ),
    ] = None,
    qat_init: Annotated[
        str,
        typer.Option(
            help="--qat: start from the float weights (float) or from a post-training solution for the scheme (gptq or awq: `llmq quantize --method gptq|awq` first, default calibration; AWQ's scales folded into the norms come with it)."
        ),
    ] = "float",
    checkpoint_every: Annotated[
        int | None,
        typer.Option(
            help="Steps between resume points (student, optimizer, data position). Default: by time, see --resume-every."
        ),
    ] = None,
    resume_every: Annotated[
        float,
        typer.Option(
            help="Seconds between resume points when --checkpoint-every is not given; an interruption loses at most this much training."
        ),
    ] = DISTILL_RESUME_EVERY_S,
    sharding: Annotated[
        str,
        typer.Option(
            help="Under torchrun: ddp replicates the student, its AdamW state and the teacher in every process; fsdp (FSDP2) shards all three over the processes, each holding 1/N and gathering one decoder layer at a time (for models DDP does not fit). Resume points are then written by every process (torch.distributed.checkpoint) and need the same number of processes."
        ),
    ] = "ddp",
    resume: Resume = False,
    overwrite: Overwrite = False,
    evaluate: Annotated[
        bool,
        typer.Option(
            help="Report teacher, student and result perplexity under `llmq eval`'s default protocol, and the share of the gap recovered."
        ),
    ] = True,
    reference: Reference = True,
    space_check: SpaceCheck = True,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Distill TEACHER into STUDENT: train the student on the teacher's next-token
    distributions (KL divergence), then write it as a plain checkpoint every loader reads.

    The usual chain: `llmq prune --structured` makes the student, `llmq distill` repairs it,
    `llmq quantize` compresses it. Data-parallel on several GPUs or CPU processes:
    `torchrun --nproc-per-node N -m llmq distill ...` (each process takes its slice of every
    global batch). Zeros of a pruned student (linears at least 10% zeros) stay zero.
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
