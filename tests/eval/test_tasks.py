"""Built-in lm-eval tasks: built deterministically from held-out Hamlet, run offline, gated
with the right exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmq.cli.main import app
from llmq.eval.tasks import ITEMS, build
from llmq.texts import builtin_documents
from tests.conftest import assert_bad_input

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_builder_is_deterministic_and_reads_only_held_out_hamlet(tmp_path: Path) -> None:
    first, second = build(tmp_path / "a"), build(tmp_path / "b")
    for name in first:
        assert first[name].read_bytes() == second[name].read_bytes()
    play = squeeze(builtin_documents("shakespeare", "heldout")[0])
    calibration = squeeze(" ".join(builtin_documents("shakespeare", "calibration")))
    cloze = [json.loads(line) for line in first["hamlet_cloze"].open()]
    assert len(cloze) == ITEMS
    for item in cloze:
        assert squeeze(item["context"] + item["target"]) in play
    assert sum(squeeze(item["context"])[:80] in calibration for item in cloze) == 0
    choice = [json.loads(line) for line in first["hamlet_next_line"].open()]
    assert len(choice) == ITEMS
    for item in choice:
        assert len(set(item["choices"])) == 4
        true_next = squeeze(item["context"] + item["choices"][item["label"]])
        assert true_next in play


def llmq_eval(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmq", "eval", *args], cwd=REPO,
                          capture_output=True, text=True, env=env)  # fmt: skip


@pytest.mark.process
def test_tasks_run_with_the_network_off_and_no_hub_cache(tmp_path: Path, tiny_llama: Path) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "LLMQ_CACHE_DIR": str(tmp_path / "llmq")}  # fmt: skip
    done = llmq_eval(str(tiny_llama), "--baseline", str(tiny_llama), "--tasks", "hamlet_cloze,hamlet_next_line",
                     "--limit", "6", "--max-drop", "0.0", "--json", env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)[0]
    assert result["passed"] is True
    assert [row["items"] for row in result["tasks"]] == [6, 6]
    assert all(row["paired"]["difference"] == 0.0 for row in result["tasks"])


@pytest.mark.integration
@pytest.mark.process
def test_a_damaged_model_fails_the_gate_and_the_same_model_passes(tmp_path: Path, default_model: Path) -> None:  # fmt: skip
    """Magnitude pruning at 80% leaves the default model near chance on the next-line task."""
    import llmq

    damaged = tmp_path / "damaged"
    llmq.prune(default_model, damaged, method="magnitude", sparsity=0.8, skip_layer_check=True, reference=False)  # fmt: skip
    common = ["--baseline", str(default_model), "--tasks", "hamlet_next_line", "--limit", "60"]
    failed = runner.invoke(app, ["eval", str(damaged), *common, "--max-drop", "0.05"])
    assert failed.exit_code == 1, failed.output
    assert "FAIL" in failed.output
    same = runner.invoke(app, ["eval", str(default_model), *common, "--min-recovery", "0.95", "--batch-size", "3"])  # fmt: skip
    assert same.exit_code == 0, same.output


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--tasks", "lambada"], "unknown task 'lambada'"),
        (["--tasks", "hamlet_cloze", "--max-drop", "0.02"], "give --baseline"),
        (["--tasks", "hamlet_cloze", "--limit", "0"], "--limit 0"),
        (["--tasks", "hamlet_cloze", "--baseline", "x", "--max-drop", "lots"], "--max-drop 'lots'"),
        (
            ["--tasks", "hamlet_cloze", "--baseline", "x", "--max-drop", "other=0.1"],
            "not one of --tasks",
        ),
        (["--tasks", "hamlet_cloze", "--max-ppl-increase", "3%"], "with --tasks use --max-drop"),
    ],
)
def test_bad_task_options_exit_2(tiny_llama: Path, args: list[str], fragment: str) -> None:
    assert_bad_input(runner.invoke(app, ["eval", str(tiny_llama), *args]), fragment)
