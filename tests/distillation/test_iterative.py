"""Iterative pruning on the distillation loop: rounds of one-shot pruning and distillation,
their sparsity schedule, zeros that never come back, the per-round report, resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.recipes.iterative import round_sparsities
from tests.conftest import assert_bad_input
from tests.distillation.test_distill import FAST, InterruptAfter, assert_same_weights, weights

runner = CliRunner()
ROUNDS = {"method": "wanda", "sparsity": 0.5, "rounds": 2}
ITERATIVE = {**FAST, "lr": 1e-3, "iterative": ROUNDS, "steps_per_round": 2, "keep": "last"}


def decoder_linears(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights(folder).items() if k.endswith("proj.weight")}


def test_every_round_removes_the_same_share_of_what_remains() -> None:
    got = round_sparsities(0.7, 3, "geometric")
    densities = [1.0] + [1 - s for s in got]
    shares = [1 - densities[r + 1] / densities[r] for r in range(3)]
    assert shares == pytest.approx([shares[0]] * 3, abs=1e-12)
    assert got[-1] == pytest.approx(0.7, abs=1e-12)
    assert round_sparsities(0.5, 1, "geometric") == [0.5]


def test_the_cubic_round_schedule_is_gmps_formula_at_the_round_ends() -> None:
    """s (1 - (1 - r/R)^3) for R = 3, s = 0.7: 0.7 x 19/27, 0.7 x 26/27, 0.7; and it prunes
    more than the geometric schedule in every round but the last."""
    got = round_sparsities(0.7, 3, "cubic")
    assert got == pytest.approx([0.7 * 19 / 27, 0.7 * 26 / 27, 0.7], abs=1e-12)
    assert all(
        c > g for c, g in zip(got[:-1], round_sparsities(0.7, 3, "geometric")[:-1], strict=True)
    )


def test_structured_rounds_keep_the_schedules_densities() -> None:
    """Structured rounds prune a share of the current decoder: their product is the target's
    density, and each is the ratio of successive densities of the schedule."""
    import math

    from llmq.config import DistillConfig
    from llmq.config.distill import IterativeConfig
    from llmq.recipes.iterative import rounds_recipe

    for schedule in ("geometric", "cubic"):
        rounds = IterativeConfig(method="structured", sparsity=0.4, rounds=3, schedule=schedule)
        config = DistillConfig(iterative=rounds, max_steps=3)
        stages = rounds_recipe(config, Path("teacher"), None).model_dump()["stages"]
        keeps = [stage["prune"]["decoder_params"] for stage in stages if stage.get("prune")]
        assert math.prod(keeps) == pytest.approx(0.6, abs=1e-12)
        densities = [1.0] + [1 - s for s in round_sparsities(0.4, 3, schedule)]
        assert keeps == pytest.approx([densities[r + 1] / densities[r] for r in range(3)])


@pytest.mark.slow
def test_rounds_prune_then_distill_and_report_each(
    tmp_path: Path, teacher: Path, student: Path
) -> None:
    out = tmp_path / "out"
    result = llmq.distill(teacher, student, out, **ITERATIVE)
    assert [r["round"] for r in result.rounds] == [1, 2]
    # each row loses round(s x in_features) weights: within one weight of the target
    assert result.rounds[0]["sparsity"] == pytest.approx(0.5 * (1 - 0.5**3), abs=1 / 128)  # cubic
    assert result.rounds[1]["sparsity"] == pytest.approx(0.5, abs=1 / 128)
    assert result.steps == 4 and [e["step"] for e in result.evaluations] == [0, 2, 2, 4]
    for r in result.rounds:  # the report is the rounds' own held-out evaluations
        assert r["perplexity_pruned"] > 1 and r["perplexity_kept"] == r["perplexity_distilled"]
    for name, weight in decoder_linears(out).items():
        assert (weight == 0).float().mean() == pytest.approx(0.5, abs=1 / 128), name
    record = json.loads((out / "llmq.json").read_text())["distillation"]
    assert record["rounds"] == result.rounds
    assert not list(tmp_path.glob(".out.*")), "the staging folder is removed"


@pytest.mark.slow
def test_an_interrupted_run_resumes_in_its_round_to_the_same_weights(
    tmp_path: Path, teacher: Path, student: Path
) -> None:
    options = {**ITERATIVE, "checkpoint_every": 1}
    llmq.distill(teacher, student, tmp_path / "whole", **options)
    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):  # in round 2's distillation, after its first step
        llmq.distill(teacher, student, resumed, progress=InterruptAfter(3), **options)
    staging = next(tmp_path.glob(".resumed.*"))
    pruned = decoder_linears(staging / "3-prune-2")  # round 1's distilled student: removed
    assert not (staging / "2-distill-1").exists()
    llmq.distill(teacher, student, resumed, resume=True, **options)
    assert_same_weights(tmp_path / "whole", resumed)
    final = decoder_linears(resumed)
    for name, weight in pruned.items():  # round 2's zeros survived its distillation
        assert (final[name][weight == 0] == 0).all(), name


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--prune", "iterative"], "iterative.sparsity: Field required"),
        (["--prune", "iterative", "--pattern", "2:4"], "--pattern: goes with --prune gmp"),
        (
            ["--prune", "iterative", "--sparsity", "0.5", "--max-steps", "5"],
            "not a multiple of iterative.rounds 3",
        ),
        (
            ["--prune", "iterative", "--sparsity", "0.5", "--prune-end", "2"],
            "--prune-end: goes with --prune gmp",
        ),
        (
            ["--prune", "gmp", "--sparsity", "0.5", "--rounds", "2"],
            "--rounds: goes with --prune iterative",
        ),
        (["--steps-per-round", "2", "--max-steps", "4"], "goes with --prune iterative"),
        (["--round-schedule", "geometric"], "--round-schedule: goes with --prune iterative"),
        (
            ["--prune", "iterative", "--sparsity", "0.5", "--round-schedule", "linear"],
            "iterative.schedule: Input should be 'cubic' or 'geometric'",
        ),
        (
            [
                "--prune",
                "iterative",
                "--sparsity",
                "0.5",
                "--steps-per-round",
                "2",
                "--max-steps",
                "6",
            ],
            "not both",
        ),
    ],
)
def test_bad_iterative_options_exit_2(
    tmp_path: Path, teacher: Path, student: Path, args: list[str], fragment: str
) -> None:
    base = ["distill", "--teacher", str(teacher), "--student", str(student), "--out", str(tmp_path / "o")]  # fmt: skip
    if "--max-steps" not in args and "--steps-per-round" not in args:
        base += ["--max-steps", "6"]
    assert_bad_input(runner.invoke(app, [*base, *args]), fragment)
    assert not (tmp_path / "o").exists()


def test_structured_rounds_narrow_the_mlp_each_round(tmp_path: Path, teacher: Path) -> None:
    out = tmp_path / "out"
    rounds = {**ROUNDS, "method": "structured", "sparsity": 0.3}
    options = {**ITERATIVE, "iterative": rounds, "steps_per_round": 1}
    result = llmq.distill(teacher, teacher, out, **options)
    before = json.loads((teacher / "config.json").read_text())["intermediate_size"]
    after = json.loads((out / "config.json").read_text())["intermediate_size"]
    assert after < before
    first, second = (r["parameters"] for r in result.rounds)
    assert second < first and result.sparsity is None
    assert llmq.verify(out, loaders=["transformers"]).passed
