"""One DistillConfig however a distillation is asked for: `llmq distill`'s flags, a recipe's
distill stage and Python's keywords record the same config in llmq.json, for each of its
sub-configs (gmp, qat, iterative). A recipe stage takes no iterative pruning (its rounds are
stages of their own), so that one is the CLI against Python."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import llmq
from llmq.api.chain import run
from llmq.cli.main import app
from tests.distillation.test_distill import FAST, FAST_CLI

pytestmark = pytest.mark.slow  # three distillations a case
runner = CliRunner()
SHARED = {"max_steps": 2, "seq_len": 64, "batch_size": 2, "grad_accum": 2, "eval_windows": 2, "eval_seq_len": 64, "lr": 1e-3}  # fmt: skip

JOBS: dict[str, tuple[list[str], dict[str, Any]]] = {
    # name: (the flags, the sub-config they make)
    "gmp": (
        ["--prune", "gmp", "--prune-method", "wanda", "--sparsity", "0.5", "--prune-end", "1"],
        {"gmp": {"method": "wanda", "sparsity": 0.5, "end": 1}},
    ),
    "qat": (
        ["--qat", "w8a16", "--qat-group-size", "64"],
        {"qat": {"scheme": "w8a16", "group_size": 64}},
    ),
    "iterative": (
        [
            "--prune",
            "iterative",
            "--sparsity",
            "50%",
            "--rounds",
            "2",
            "--round-schedule",
            "geometric",
        ],
        {"iterative": {"sparsity": 0.5, "rounds": 2, "schedule": "geometric"}},
    ),
}


def recorded(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "llmq.json").read_text())["distillation"]["config"]


@pytest.mark.parametrize("job", sorted(JOBS))
def test_cli_yaml_and_python_record_the_same_config(
    job: str, tmp_path: Path, teacher: Path, student: Path
) -> None:
    flags, sub_config = JOBS[job]
    shared_flags = [f"--{k.replace('_', '-')}={v}" for k, v in SHARED.items()]
    cli_out = tmp_path / "cli"
    args = ["distill", "--teacher", str(teacher), "--student", str(student), "--out", str(cli_out)]  # fmt: skip
    result = runner.invoke(app, [*args, *FAST_CLI, *shared_flags, *flags])
    assert result.exit_code == 0, result.output
    expected = recorded(cli_out)
    assert {k: v for k, v in expected[job].items() if k in sub_config[job]} == sub_config[job]

    python_out = tmp_path / "python"
    llmq.distill(teacher, student, python_out, **{**FAST, **SHARED, **sub_config})
    assert recorded(python_out) == expected
    if job == "iterative":
        return
    recipe = tmp_path / "recipe.yaml"  # JSON is YAML
    recipe.write_text(json.dumps({"stages": [{"distill": {"teacher": str(teacher), **SHARED, **sub_config}}]}))  # fmt: skip
    run(recipe, student, tmp_path / "yaml")
    assert recorded(tmp_path / "yaml" / "1-distill") == expected
