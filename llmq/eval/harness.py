"""Task accuracy through lm-eval's Python API (`simple_evaluate` with `HFLM` around the model
llmq loads in memory), offline: built-in tasks read local JSONL files, a `--task-dir` holds the
user's own lm-eval task YAMLs.

Any checkpoint is scored as it runs: a float one as it is, an llmq / compressed-tensors one
with its weights dequantized and, where its scheme quantizes activations, those fake-quantized
per token (`load_dequantized(quantize_inputs=True)`, what `llmq eval`'s perplexity simulates).
lm-eval's per-item scores are kept (`log_samples`) for the paired gates; its own bootstrap is
off (`bootstrap_iters=0`: 100k resamples are slow on a CPU and the gates do not use them).
Results are cached per (checkpoint files, tasks, limit, few-shot, seed, lm-eval version).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmq.errors import InputError
from llmq.io.cache import read_cached, write_cached
from llmq.io.checkpoint import Checkpoint


@dataclass(frozen=True, slots=True)
class TaskScores:
    task: str
    metric: str  # the task's first metric (the one gates read)
    items: dict[int, float]  # lm-eval doc_id -> score
    seconds: float
    cached: bool = False

    @property
    def score(self) -> float:
        return sum(self.items.values()) / len(self.items)


def score_tasks(
    ckpt: Checkpoint,
    tasks: list[str],
    *,
    task_dir: Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    device: str | None = None,
    cache: Path | None = None,
) -> dict[str, TaskScores]:
    """Per-item scores of every task for the checkpoint (from `cache` when it has them)."""
    key = _cache_key(ckpt, tasks, task_dir, limit, num_fewshot, seed)
    path = None if cache is None else cache / f"{key}.json"
    if path is not None:
        cached = read_cached(path, _load_scores)
        if cached is not None:
            return cached
    started = time.perf_counter()
    samples, metrics = _run_lm_eval(ckpt, tasks, task_dir, limit, num_fewshot, seed, batch_size, device)  # fmt: skip
    seconds = time.perf_counter() - started
    scores = {
        task: TaskScores(
            task,
            metrics[task],
            {int(s["doc_id"]): float(s[metrics[task]]) for s in samples[task]},
            seconds,
        )
        for task in tasks
    }
    if path is not None:
        data = {t: asdict(s) for t, s in scores.items()}
        write_cached(path, lambda partial: partial.write_text(json.dumps(data)))
    return scores


def _run_lm_eval(
    ckpt: Checkpoint,
    tasks: list[str],
    task_dir: Path | None,
    limit: int | None,
    num_fewshot: int | None,
    seed: int,
    batch_size: int,
    device: str | None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    try:
        import lm_eval
    except ImportError:
        raise InputError("--tasks runs lm-eval, which is not installed", hint="pip install 'llmq[eval]'") from None  # fmt: skip
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from llmq.calib.stream import resolve_device
    from llmq.eval.tasks import task_config, task_files
    from llmq.runtime.load import load_dequantized

    run_device = resolve_device(device)
    model = load_dequantized(ckpt, quantize_inputs=True).to(run_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt.path)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(run_device))  # fmt: skip
    if task_dir is None:
        files = task_files()
        requested: list[Any] = [task_config(t, files[t], num_fewshot=num_fewshot) for t in tasks]
        manager = None
    else:
        requested, manager = list(tasks), TaskManager(include_path=str(task_dir))
    try:
        with (
            contextlib.redirect_stderr(io.StringIO()),
            _no_git_describe(),
        ):  # lm-eval's own bars: it has no switch
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=requested,
                task_manager=manager,
                limit=limit,
                num_fewshot=num_fewshot if task_dir is not None else None,
                log_samples=True,
                bootstrap_iters=0,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
    except (KeyError, ValueError, FileNotFoundError) as exc:
        raise InputError(f"lm-eval could not run {', '.join(tasks)}: {exc}") from None
    metrics = {task: _first_metric(results["results"][task]) for task in tasks}
    return results["samples"], metrics


@contextlib.contextmanager
def _no_git_describe() -> Iterator[None]:
    """lm-eval records the git commit of the current folder by running `git describe`, whose
    `fatal: not a git repository` goes straight to the terminal outside a repository (and the
    commit of the user's folder says nothing about the model); llmq records its own provenance."""
    import lm_eval.evaluator

    recorded = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = recorded


def _first_metric(result: dict[str, Any]) -> str:
    """The task's first reported metric ('acc,none' -> 'acc')."""
    for key, value in result.items():
        if "," in key and not key.split(",")[0].endswith("_stderr") and isinstance(value, float | int):  # fmt: skip
            return key.split(",")[0]
    raise InputError(f"task {result.get('alias')!r} reported no metric")


def _cache_key(ckpt: Checkpoint, tasks: list[str], task_dir: Path | None, limit: int | None, num_fewshot: int | None, seed: int) -> str:  # fmt: skip
    from importlib.metadata import version

    from llmq.eval.tasks import TASK_VERSION

    parts = {
        "model": ckpt.file_stamps(), "tasks": tasks, "limit": limit, "fewshot": num_fewshot,
        "seed": seed, "lm_eval": version("lm_eval"), "builtin": TASK_VERSION,
        "task_dir": None if task_dir is None else _folder_stamp(task_dir),
    }  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _folder_stamp(folder: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def _load_scores(path: Path) -> dict[str, TaskScores]:
    data = json.loads(path.read_text())
    return {
        task: TaskScores(
            s["task"],
            s["metric"],
            {int(k): float(v) for k, v in s["items"].items()},
            s["seconds"],
            cached=True,
        )
        for task, s in data.items()
    }
