"""Gradual pruning on the distillation loop: the cubic schedule against its formula, masks that
only shrink, Wanda's metric from running input norms, exact zeros in the written student,
resume, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.config import DistillConfig
from llmq.config.distill import GmpConfig
from llmq.distillation.gmp import InputNorms, is_pruning_step, prune_step, scheduled_sparsity
from tests.conftest import assert_bad_input
from tests.distillation.test_distill import FAST, InterruptAfter, assert_same_weights

runner = CliRunner()


def test_the_schedule_is_zhu_and_guptas_cubic() -> None:
    config = DistillConfig(max_steps=20, gmp=GmpConfig(sparsity=0.6, start=2, end=12, every=3))  # fmt: skip
    for step in range(20):
        if step < 2:
            expected = 0.0
        elif step >= 12:
            expected = 0.6
        else:
            last = 2 + (step - 2) // 3 * 3  # the pruning step at or before this one
            expected = 0.6 * (1 - (1 - (last - 2) / 10) ** 3)
        assert scheduled_sparsity(step, config) == pytest.approx(expected, abs=1e-15), step
    assert [s for s in range(20) if is_pruning_step(s, config)] == [2, 5, 8, 11, 12]


def test_masks_only_shrink_and_each_row_loses_its_share() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    config = DistillConfig(max_steps=10, gmp=GmpConfig(sparsity=0.5, end=8))
    masks: dict[str, torch.Tensor] = {}
    previous: dict[str, torch.Tensor] = {}
    for step in range(9):
        with torch.no_grad():  # training moves the surviving weights between pruning steps
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3 * (p != 0))
        prune_step(model, masks, step, config)
        for name, keep in masks.items():
            if name in previous:
                assert not (keep & ~previous[name]).any(), "a pruned weight came back"
            columns = keep.shape[1]
            expected = round(scheduled_sparsity(step, config) * columns)
            assert ((~keep).sum(dim=1) == expected).all()
        previous = {k: v.clone() for k, v in masks.items()}
    assert all((~keep).float().mean() == 0.5 for keep in masks.values())


def test_an_nm_pattern_is_reached_group_by_group() -> None:
    model = nn.Sequential(nn.Linear(8, 3))
    config = DistillConfig(max_steps=4, gmp=GmpConfig(pattern="2:4", end=2))
    masks: dict[str, torch.Tensor] = {}
    for step in range(3):
        prune_step(model, masks, step, config)
    groups = model[0].weight.detach().reshape(3, 2, 4)
    assert ((groups == 0).sum(dim=-1) == 2).all()


def test_input_norms_sum_the_squares_of_training_inputs_only() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    norms = InputNorms(model)
    x = [torch.randn(4, 5, 3) for _ in range(2)]
    for batch in x:
        model(batch)
    model.eval()
    model(torch.randn(4, 5, 3) * 100)  # evaluation does not count
    expected = sum(batch.double().square().sum(dim=(0, 1)) for batch in x)
    assert torch.allclose(norms.squares["0.weight"].double(), expected, rtol=1e-6)
    assert not norms.empty
    norms.reset()
    assert norms.empty


def test_wanda_gmp_drops_the_smallest_weight_times_input_norm() -> None:
    model = nn.Sequential(nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 3.0]]))
    norms = InputNorms(model)
    model(torch.tensor([[4.0, 1.0]]))  # ||x|| = [4, 1]: scores 4 and 3, magnitude says 1 and 3
    config = DistillConfig(max_steps=2, gmp=GmpConfig(method="wanda", sparsity=0.5, end=1))
    masks: dict[str, torch.Tensor] = {}
    prune_step(model, masks, 1, config, norms)
    assert model[0].weight.tolist() == [[1.0, 0.0]]


def test_a_reduction_over_processes_replaces_the_sums() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    norms = InputNorms(model)
    model(torch.ones(1, 2))
    norms.reduce(lambda flat: flat * 2)  # two processes that saw the same input
    assert norms.squares["0.weight"].tolist() == [2.0, 2.0]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_gmp_distillation_writes_exact_zeros_and_resumes_identically(
    tmp_path: Path, teacher: Path, student: Path, method: str
) -> None:
    options = {**FAST, "max_steps": 6, "lr": 1e-3, "checkpoint_every": 2, "keep": "last",
               "gmp": {"sparsity": 0.5, "end": 4, "method": method}}  # fmt: skip
    whole = llmq.distill(teacher, student, tmp_path / "whole", **options)
    config = DistillConfig(**{k: v for k, v in options.items() if k in DistillConfig.model_fields})
    assert whole.sparsity_schedule == [scheduled_sparsity(s, config) for s in range(6)]
    assert whole.sparsity == 0.5
    written = load_file(next((tmp_path / "whole").glob("*00002-of-*.safetensors")))
    q = written["model.layers.0.self_attn.q_proj.weight"]
    assert ((q == 0).sum(dim=1) == q.shape[1] // 2).all()
    with pytest.raises(KeyboardInterrupt):
        llmq.distill(teacher, student, tmp_path / "resumed", progress=InterruptAfter(3), **options)
    resumed = llmq.distill(teacher, student, tmp_path / "resumed", resume=True, **options)
    assert resumed.losses == whole.losses
    assert_same_weights(tmp_path / "whole", tmp_path / "resumed")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--prune", "gmp"], "give either sparsity or pattern"),
        (
            ["--prune", "gmp", "--sparsity", "0.5", "--prune-start", "3", "--prune-end", "2"],
            "gmp.end 2: must come after gmp.start 3",
        ),
        (["--sparsity", "0.5"], "--sparsity: goes with --prune gmp or --prune iterative"),
        (
            ["--prune", "gmp", "--sparsity", "0.5", "--prune-method", "sparsegpt"],
            "gmp.method: Input should be 'magnitude' or 'wanda'",
        ),
        (["--prune-method", "wanda"], "--prune-method: goes with --prune gmp or --prune iterative"),
        (["--prune", "gmp", "--pattern", "3:7"], "7 does not divide the 192 inputs"),
        (["--prune", "magnitude", "--sparsity", "0.5"], "--prune 'magnitude': not a way to prune"),
    ],
)
def test_bad_pruning_options_exit_2(
    tmp_path: Path, teacher: Path, student: Path, args: list[str], fragment: str
) -> None:
    base = ["distill", "--teacher", str(teacher), "--student", str(student), "--out", str(tmp_path / "o"), "--max-steps", "4"]  # fmt: skip
    assert_bad_input(runner.invoke(app, [*base, *args]), fragment)
    assert not (tmp_path / "o").exists()
