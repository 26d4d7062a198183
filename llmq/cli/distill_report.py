"""`llmq distill`'s report: the table a person reads (--json gives the whole result)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from llmq.cli.console import out_console


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
        how = "gmp" if config["gmp"] else "iterative"
        table.add_row(f"sparsity of the decoder's linears ({how})", f"{result.sparsity:.1%}")
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
