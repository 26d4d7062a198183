"""Mixed precision under a perplexity gate: quantize at the target bits, score held-out text
against the source, and while the increase exceeds the gate, raise the budget by a step and
quantize again, until it passes or no budget buys more (exit 1, the last attempt kept). The
damages are measured once: only the solve and the quantization depend on the budget."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.config import Recipe
from llmq.errors import GateFailed
from llmq.io.atomic import add_to_record
from llmq.io.checkpoint import Checkpoint, open_checkpoint
from llmq.pipeline.job import JobInputs, JobRun, mixed_budget, run_job
from llmq.pipeline.plan import plan_quantization
from llmq.pipeline.report import QuantizeResult
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:
    from llmq.calib.data import TokenWindows


def run_gated_job(
    ckpt: Checkpoint,
    out: Path,
    recipe: Recipe,
    *,
    source: str,
    inputs: JobInputs,
    run: JobRun,
    progress: Progress = NO_PROGRESS,
) -> QuantizeResult:
    """`run_job` for a mixed recipe with `max_ppl_increase`, spending more bits until the
    held-out perplexity passes; the result lists every attempt."""
    from llmq.calib.data import evaluation_windows
    from llmq.calib.tokenizer import load_tokenizer

    mixed = recipe.mixed
    assert mixed is not None and mixed.max_ppl_increase is not None and mixed.target_bits is not None  # fmt: skip
    most = mixed_budget(ckpt, plan_quantization(ckpt, recipe), recipe, inputs).most_bits  # type: ignore[union-attr]
    windows = evaluation_windows(
        load_tokenizer(ckpt.path), mixed.eval_text, seq_len=512, max_windows=mixed.eval_windows
    )
    base = _perplexity(ckpt, windows, progress, run.device)
    attempts: list[dict[str, Any]] = []
    damages: dict[str, list[float]] = {}  # measured once: they do not depend on the budget
    target = mixed.target_bits
    while True:
        attempt = recipe.model_copy(update={"mixed": mixed.model_copy(update={"target_bits": target})})  # fmt: skip
        result = run_job(ckpt, out, attempt, source=source, inputs=inputs, run=run, progress=progress, damages=damages)  # fmt: skip
        increase = _perplexity(open_checkpoint(out), windows, progress, run.device) / base - 1
        attempts.append({"target_bits": target, "written_bits": result.mixed_precision["written_bits"], "ppl_increase": increase})  # type: ignore[index]  # fmt: skip
        gate = {"max_ppl_increase": mixed.max_ppl_increase, "text": mixed.eval_text, "windows": len(windows.input_ids), "attempts": attempts}  # fmt: skip
        result.mixed_precision["gate"] = gate  # type: ignore[index]
        run.processes.on_main(partial(add_to_record, out, mixed_precision=result.mixed_precision))
        if increase <= mixed.max_ppl_increase:
            return result
        if target >= most:
            raise GateFailed(
                f"--max-ppl-increase {mixed.max_ppl_increase:.2%}: perplexity on {mixed.eval_text} "
                f"rose {increase:.2%} even at {target:g} bits, the most the candidates store; "
                f"{out} holds that attempt",
                hint="allow a larger increase, or add costlier candidates (int8, dense)",
            )
        target = min(target + mixed.step_bits, most)
        run = replace(run, overwrite=True, resume=False)  # the attempt before is llmq's output


def _perplexity(ckpt: Checkpoint, windows: TokenWindows, progress: Progress, device: str | None) -> float:  # fmt: skip
    from llmq.eval.ppl import perplexity

    return perplexity(ckpt, windows, progress=progress, device=device).perplexity
