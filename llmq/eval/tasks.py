"""llmq's built-in lm-eval tasks, built from Hamlet (public domain, the held-out split of the
built-in Shakespeare text, which calibration never reads) by deterministic rules.

- `hamlet_cloze` (LAMBADA-style, loglikelihood): a speech of 30-150 words up to its last word;
  the model must predict that word. Metric `acc`: the word is the greedy continuation.
- `hamlet_next_line` (multiple choice): two consecutive verse lines of a speech; which of four
  lines comes next? The three distractors are verse lines of other speeches of similar length,
  drawn with a fixed seed. Metrics `acc` and `acc_norm` (log-likelihood per byte).

Items are spread evenly over the play (every k-th qualifying speech), so a `--limit` prefix still
samples all five acts. `python -m llmq.eval.tasks DIR` writes the JSONL files and a data card.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmq.errors import InputError

TASK_VERSION = 1  # bump when a rule changes: cached task files are keyed on it
ITEMS = 300
_WORD = re.compile(r"[A-Za-z][A-Za-z']*[A-Za-z]")
_SPEAKER = re.compile(r"^[A-Z][A-Z .']+$")


@dataclass(frozen=True, slots=True)
class BuiltinTask:
    name: str
    description: str
    output_type: str  # lm-eval's: loglikelihood or multiple_choice
    metrics: tuple[str, ...]


BUILTIN_TASKS = {
    t.name: t
    for t in (
        BuiltinTask(
            "hamlet_cloze",
            "last word of a Hamlet speech, LAMBADA-style (acc)",
            "loglikelihood",
            ("acc",),
        ),
        BuiltinTask(
            "hamlet_next_line",
            "which of 4 lines comes next in Hamlet (acc, acc_norm)",
            "multiple_choice",
            ("acc", "acc_norm"),
        ),
    )
}


def speeches(play: str) -> list[list[str]]:
    """The play's speeches, as their verse lines: blocks of text between blank lines, without
    the speaker's name (a stage direction is a short block of its own)."""
    found = []
    for block in re.split(r"\n\s*\n", play):
        lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
        if lines and _SPEAKER.match(lines[0]):
            lines = lines[1:]
        if lines:
            found.append(lines)
    return found


def cloze_items(play: str, count: int = ITEMS) -> list[dict[str, str]]:
    """Targets: words (3 letters or more) that end a sentence or clause, at least 30 words into
    a speech and 60 words after the speech's previous target; context: up to 150 words of the
    speech before the target."""
    candidates = []
    for lines in speeches(play):
        words = " ".join(lines).split()
        previous = -60
        for k in range(30, len(words)):
            if k - previous < 60 or not _is_target(words[k]):
                continue
            word = _WORD.match(words[k])
            assert word is not None  # _is_target checked it
            context = " ".join(words[max(0, k - 150) : k])
            candidates.append({"context": context, "target": " " + word.group()})
            previous = k
    return _spread(candidates, count)


def _is_target(token: str) -> bool:
    """A word that ends a sentence or clause: letters (3 or more), then punctuation."""
    word = _WORD.match(token)
    return word is not None and len(word.group()) >= 3 and token[word.end():] in (".", "!", "?", ";", ":", ",")  # fmt: skip


def next_line_items(play: str, count: int = ITEMS, seed: int = 0) -> list[dict[str, Any]]:
    """Context: two lines; choices: the next line and three lines of other speeches."""
    all_speeches = speeches(play)
    pool = [(i, line) for i, lines in enumerate(all_speeches) for line in lines if len(line.split()) >= 4]  # fmt: skip
    rng = random.Random(seed)
    candidates = []
    for index, lines in enumerate(all_speeches):
        if len(lines) < 3 or len(lines[2].split()) < 4:
            continue
        answer = lines[2]
        similar = [line for i, line in pool if i != index and abs(len(line) - len(answer)) <= 12 and line != answer]  # fmt: skip
        if len(similar) < 3:
            continue
        choices = [*rng.sample(similar, 3), answer]
        rng.shuffle(choices)
        candidates.append({"context": f"{lines[0]}\n{lines[1]}\n", "choices": choices, "label": choices.index(answer)})  # fmt: skip
    return _spread(candidates, count)


def _spread(items: list[Any], count: int) -> list[Any]:
    """`count` items evenly spaced over the list (all of them when there are fewer)."""
    if len(items) <= count:
        return items
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def build(folder: Path) -> dict[str, Path]:
    """Write every built-in task's items as JSONL into `folder`; the paths by task name."""
    from llmq.io.atomic import write_text
    from llmq.texts import builtin_documents

    play = builtin_documents("shakespeare", "heldout")[0]
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, items in (("hamlet_cloze", cloze_items(play)), ("hamlet_next_line", next_line_items(play))):  # fmt: skip
        path = folder / f"{name}.jsonl"
        write_text(path, "".join(json.dumps(item) + "\n" for item in items))
        paths[name] = path
    return paths


def task_files() -> dict[str, Path]:
    """The built-in tasks' JSONL files, built once into llmq's cache."""
    from llmq.models import cache_dir

    folder = cache_dir() / "tasks" / f"v{TASK_VERSION}"
    paths = {name: folder / f"{name}.jsonl" for name in BUILTIN_TASKS}
    if not all(path.is_file() for path in paths.values()):
        build(folder)
    return paths


def task_config(name: str, path: Path, *, num_fewshot: int | None = None) -> dict[str, Any]:
    """The lm-eval task config of a built-in task, reading its local JSONL file (no hub)."""
    task = BUILTIN_TASKS[name]
    config: dict[str, Any] = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(path)}},
        "test_split": "test",
        "output_type": task.output_type,
        "doc_to_text": "{{context}}",
        "metric_list": [
            {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in task.metrics
        ],
        "metadata": {"version": TASK_VERSION},
    }
    if task.output_type == "multiple_choice":
        config.update(doc_to_target="{{label}}", doc_to_choice="{{choices}}")
    else:
        config.update(doc_to_target="{{target}}")
    if num_fewshot:
        config.update(fewshot_split="test", num_fewshot=num_fewshot)
    return config


def fingerprint(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def check_task_names(names: list[str], task_dir: Path | None) -> None:
    unknown = [n for n in names if n not in BUILTIN_TASKS] if task_dir is None else []
    if unknown:
        raise InputError(
            f"unknown task {unknown[0]!r}",
            hint=f"built-in tasks: {', '.join(BUILTIN_TASKS)}; your own task folder: --task-dir",
        )


if __name__ == "__main__":
    import sys

    for task_name, written in build(Path(sys.argv[1])).items():
        print(f"{task_name}: {sum(1 for _ in written.open())} items -> {written}")
