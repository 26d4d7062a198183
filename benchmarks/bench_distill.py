"""Distillation of a structured-pruned default model on this machine's CPU (issue 34's targets).

    python benchmarks/bench_distill.py [--steps 60 --lr 2e-4 --windows 20 --data shakespeare+pydoc]

Teacher: SmolLM2-135M-Instruct (float32). Student: the teacher with its MLP narrowed by
`llmq prune --structured --intermediate-size 1024` (activation importance on llmq's default
calibration text; 1536 -> 1024 channels, -25% of the decoder's parameters, -20% of all with the
embedding).
Both runs train the same student for the same steps on the same windows (the calibration
splits of --data, by default shakespeare+pydoc, 512-token windows, 4 a step, seed 0; AdamW, warm-up then cosine,
the last step's student kept, no selection on any evaluation text):
- KD: `llmq distill --loss forward-kl` (T = 1);
- fine-tuning: `llmq distill --loss ce`, plain next-token cross-entropy, no teacher.
Each is a `llmq distill` process, timed with its peak RSS. Perplexity protocol: token
perplexity, first --windows non-overlapping 512-token windows of the held-out splits of news
(Lee corpus, articles after the first 100) and Hamlet (no play of the training data), no BOS,
float32. Recovery: (student - distilled) / (student - teacher) per text.

Also, side by side in this process: training throughput of llmq's step against a plain PyTorch
loop doing the same forward passes, KL loss, backward and AdamW step on the same windows
(interleaved, median of --repeats); and greedy batch-1 decode of teacher and student.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, run_measured, write_json

TEXTS = {"news": "news", "Hamlet": "shakespeare"}  # label -> built-in text (held-out split)
SEQ_LEN, GRAD_ACCUM = 512, 4


def held_out(model: Path, windows: int) -> dict[str, float]:
    import llmq

    return {
        label: llmq.evaluate(model, text=text, max_windows=windows).model.perplexity
        for label, text in TEXTS.items()
    }


def make_student(teacher: Path, out: Path) -> Path:
    import llmq

    if not (out / "config.json").is_file():
        llmq.prune_structured(teacher, out, intermediate_size=1024, evaluate=False, overwrite=True)
    return out


def distill_cmd(teacher: Path, student: Path, out: Path, loss: str, args: argparse.Namespace) -> list[str]:  # fmt: skip
    return [sys.executable, "-m", "llmq", "distill", "--teacher", str(teacher),
            "--student", str(student), "--out", str(out), "--overwrite", "--json",
            "--loss", loss, "--max-steps", str(args.steps), "--lr", str(args.lr),
            "--warmup-steps", str(max(1, args.steps // 20)), "--grad-accum", str(GRAD_ACCUM),
            "--seq-len", str(SEQ_LEN), "--keep", "last", "--eval-every", str(max(1, args.steps // 3)),
            "--train-text", args.data, "--no-evaluate", "--no-reference"]  # fmt: skip


def throughput(teacher: Path, student: Path, repeats: int) -> dict[str, float]:
    """Tokens/s of one optimizer step (4 windows of 512 tokens): llmq's `train_step` against
    a plain loop on the same models and windows, interleaved; medians."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from llmq.calib.data import training_windows
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.config import DistillConfig
    from llmq.distillation.data import BatchOrder
    from llmq.distillation.loop import DistillRun, train_step
    from llmq.distillation.state import TrainState, parameters_of
    from llmq.processes import Processes

    windows = training_windows(load_tokenizer(student), "shakespeare+pydoc", seq_len=SEQ_LEN)
    order = BatchOrder(windows.input_ids, GRAD_ACCUM, seed=0)
    cpu = torch.device("cpu")
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval().requires_grad_(False)  # fmt: skip

    def fresh_student() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    config = DistillConfig(max_steps=10_000, grad_accum=GRAD_ACCUM, lr=1e-5)
    ours, ours_opt = fresh_student()
    run = DistillRun(config=config, teacher=teacher_model, student=ours, trained=ours,
                     optimizer=ours_opt, order=order, eval_ids=windows.input_ids[:1],
                     parameters=parameters_of(ours), masks={}, layer_pairs=[],
                     processes=Processes(), device=cpu, state=TrainState())  # fmt: skip
    plain, plain_opt = fresh_student()

    def plain_step(step: int) -> None:
        for ids in order.batch(step).split(1):
            with torch.no_grad():
                t = teacher_model(input_ids=ids, use_cache=False).logits
            s = plain(input_ids=ids, use_cache=False).logits
            loss = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1).mean()  # fmt: skip
            (loss / GRAD_ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"llmq": [], "plain": []}
    for step in range(repeats + 1):  # the first of each is a warm-up
        for name, fn in (("llmq", lambda s: train_step(run, s)), ("plain", plain_step)):
            started = time.perf_counter()
            fn(step)
            if step:
                times[name].append(time.perf_counter() - started)
    tokens = GRAD_ACCUM * SEQ_LEN
    return {name: tokens / statistics.median(t) for name, t in times.items()}


def decode_speed(model: Path, new_tokens: int, repeats: int) -> float:
    """Greedy batch-1 decode tokens/s (transformers generate, float32, 32-token prompt)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompt = torch.arange(1000, 1032).unsqueeze(0)
    rates = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            started = time.perf_counter()
            lm.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)  # fmt: skip
            rates.append(new_tokens / (time.perf_counter() - started))
    return statistics.median(rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--windows", type=int, default=20, help="512-token windows per text")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/distill"))
    parser.add_argument(
        "--data", default="shakespeare+pydoc",
        help="training text (calibration splits); pydoc alone leaves both held-out domains unseen",
    )  # fmt: skip
    parser.add_argument(
        "--training-only", action="store_true", help="skip the throughput and decode measurements"
    )
    args = parser.parse_args()

    from llmq.models import builtin_model_path

    teacher = builtin_model_path("smollm2-135m")
    args.out.mkdir(parents=True, exist_ok=True)
    student = make_student(teacher, args.out / "student")
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "steps": args.steps,
                    "lr": args.lr, "windows": args.windows, "data": args.data,
                    "teacher": held_out(teacher, args.windows), "student": held_out(student, args.windows)}  # fmt: skip
    for loss in ("forward-kl", "ce"):
        measured = run_measured(distill_cmd(teacher, student, args.out / loss, loss, args))
        result = json.loads(measured.stdout)
        report[loss] = {
            "ppl": held_out(args.out / loss, args.windows),
            "wall_s": measured.wall_s, "peak_rss_gb": measured.peak_rss_bytes / 1e9,
            "tokens": result["tokens"], "tokens_per_s": result["tokens_per_s"],
            "evaluations": result["evaluations"], "losses": result["losses"],
        }  # fmt: skip
        write_json(args.out / "results.json", report)
    if args.training_only:
        print(markdown(report))
        return
    report["throughput"] = throughput(teacher, student, args.repeats)
    report["decode"] = {name: decode_speed(path, 32, max(5, args.repeats))
                        for name, path in (("teacher", teacher), ("student", student))}  # fmt: skip
    write_json(args.out / "results.json", report)
    print(markdown(report))


def markdown(report: dict) -> str:
    teacher, student = report["teacher"], report["student"]
    lines = [
        f"Machine: {report['machine']}, {report['date']}. {report['steps']} steps x 4 windows x 512 tokens of {report.get('data', 'shakespeare+pydoc')}, lr {report['lr']}. "
        f"Perplexity: first {report['windows']} x 512-token windows of held-out news and Hamlet, no BOS, float32.",
        "",
        "| model | ppl news | ppl Hamlet | gap recovered (news / Hamlet) | tokens | wall s | train tokens/s | peak RSS GB |",
        "|---|---|---|---|---|---|---|---|",
        f"| teacher (SmolLM2-135M) | {teacher['news']:.3f} | {teacher['Hamlet']:.3f} | | | | | |",
        f"| student, MLP 1536 -> 1024, before training | {student['news']:.3f} | {student['Hamlet']:.3f} | 0% / 0% | | | | |",
    ]  # fmt: skip
    for loss, label in (("forward-kl", "distilled (forward KL)"), ("ce", "fine-tuned (cross-entropy)")):  # fmt: skip
        row = report.get(loss)
        if row is None:
            continue
        ppl = row["ppl"]
        recovered = " / ".join(
            f"{(student[t] - ppl[t]) / (student[t] - teacher[t]):.1%}" for t in TEXTS
        )
        lines.append(
            f"| {label} | {ppl['news']:.3f} | {ppl['Hamlet']:.3f} | {recovered} | {row['tokens']:,} | "
            f"{row['wall_s']:.0f} | {row['tokens_per_s']:.0f} | {row['peak_rss_gb']:.2f} |"
        )
    if "throughput" in report:
        t = report["throughput"]
        lines += ["", f"Training step throughput, same models and windows, interleaved medians: llmq {t['llmq']:.0f} tokens/s, plain PyTorch loop {t['plain']:.0f} tokens/s ({t['llmq'] / t['plain']:.2f}x)."]  # fmt: skip
    if "decode" in report:
        d = report["decode"]
        lines += [f"Greedy batch-1 decode (transformers, float32, 32-token prompt, 32 new tokens): teacher {d['teacher']:.1f} tokens/s, student {d['student']:.1f} tokens/s ({d['student'] / d['teacher']:.2f}x)."]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
