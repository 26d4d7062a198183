"""Non-uniform sparsity (OWL and scan): outlier ratios and pruning errors on hand-made weights,
the allocation rule, and profiled runs whose layers differ while the total stays the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import llmq
from llmq.calib.stats import CalibStats, InputStats
from llmq.errors import InputError
from llmq.pruning.profile import PROFILE_SPREAD, outlier_ratio, pruning_error, spread_allocation


class _Weights:
    """The part of a Checkpoint that the profiles read."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def read(self, name: str) -> torch.Tensor:
        return self.weights[name]


def test_outlier_ratio_counts_scores_above_m_times_the_layer_mean() -> None:
    # scores |w| * ||x||: input norms 1 and 2 (sums of squares 1 and 4)
    weight = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 30.0]])
    stats = CalibStats(inputs={"a": InputStats(None, None, sq_sum=torch.tensor([1.0, 4.0]))})
    # scores: four 1s, three 2s and one 60; mean 8.75: 5x = 43.75 (one above), 0.2x = 1.75 (four)
    ratio = outlier_ratio(_Weights({"a.weight": weight}), stats, ["a"])  # type: ignore[arg-type]
    assert ratio == 1 / 8
    assert outlier_ratio(_Weights({"a.weight": weight}), stats, ["a"], threshold=0.2) == 4 / 8  # type: ignore[arg-type]


def test_pruning_error_sums_what_the_method_drops_weighted_by_its_input_squares() -> None:
    weight = torch.tensor([[1.0, 1.5], [3.0, 0.5]])
    stats = CalibStats(inputs={"a": InputStats(None, None, sq_sum=torch.tensor([4.0, 1.0]))})
    ckpt = _Weights({"a.weight": weight})
    # magnitude drops 1 and 0.5: 1²·4 + 0.5²·1. Wanda scores |w|·‖x‖ = [[2, 1.5], [6, 0.5]]
    # drop 1.5 and 0.5 instead: 1.5²·1 + 0.5²·1. The whole output: 1·4 + 2.25·1 + 9·4 + 0.25·1
    assert pruning_error(ckpt, stats, "a", 0.5, "magnitude") == (4.25, 42.5)  # type: ignore[arg-type]
    assert pruning_error(ckpt, stats, "a", 0.5, "wanda") == (2.5, 42.5)  # type: ignore[arg-type]
    assert pruning_error(ckpt, stats, "a", 0.5, "sparsegpt") == (2.5, 42.5)  # type: ignore[arg-type]


def test_the_allocation_spreads_by_the_measure_around_the_target() -> None:
    got = spread_allocation([0.01, 0.03, 0.02, 0.02], 0.7)
    # densities 0, 2λ, λ, λ minus their mean λ, plus 0.3: sparsities 0.7 + λ, 0.7 - λ, 0.7, 0.7
    expected = [0.7 + PROFILE_SPREAD, 0.7 - PROFILE_SPREAD, 0.7, 0.7]
    assert got == pytest.approx(expected, abs=1e-12)
    assert sum(got) / 4 == pytest.approx(0.7)
    assert spread_allocation([0.02, 0.02], 0.5) == [0.5, 0.5]


def profiled_prune(out: Path, model: Path, method: str, profile: str) -> dict:
    """Prune MODEL to 50% with PROFILE; check that each layer got the sparsity the profile
    recorded (round(s x in_features) of every row) and that the total is the target; the
    record."""
    result = llmq.prune(
        model, out, method=method, sparsity=0.5, sparsity_profile=profile,
        num_samples=4, seq_len=64,
    )  # fmt: skip
    record = json.loads((out / "llmq.json").read_text())["sparsity_profile"]
    assert record["profile"] == profile and len(record["sparsity"]) == 2
    assert sorted(record["sparsity"]) == pytest.approx([0.5 - PROFILE_SPREAD, 0.5 + PROFILE_SPREAD])
    for layer, wanted in zip(result.layers, record["sparsity"], strict=True):
        for linear in layer.linears:
            assert linear.sparsity == pytest.approx(wanted, abs=1 / 192)
    assert result.sparsity["linears"] == pytest.approx(0.5, abs=1 / 192)
    return record


def test_an_owl_profiled_prune_spares_the_layer_with_more_outliers(
    tmp_path: Path, tiny_llama: Path
) -> None:
    record = profiled_prune(tmp_path / "out", tiny_llama, "wanda", "owl")
    more = max(range(2), key=lambda i: record["outlier_ratio"][i])
    assert record["sparsity"][more] == pytest.approx(0.5 - PROFILE_SPREAD)


def test_a_scan_profiled_prune_spares_the_layer_whose_pruning_costs_more(
    tmp_path: Path, tiny_llama: Path
) -> None:
    record = profiled_prune(tmp_path / "out", tiny_llama, "sparsegpt", "scan")
    assert sum(record["error_share"]) == pytest.approx(1.0)
    assert all(0 < r < 1 for r in record["relative_error"])
    costlier = max(range(2), key=lambda i: record["relative_error"][i])
    assert record["sparsity"][costlier] == pytest.approx(0.5 - PROFILE_SPREAD)


def test_a_profile_needs_a_fraction_and_data(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(InputError, match="N:M pattern is per group"):
        llmq.prune(tiny_llama, tmp_path / "o", pattern="2:4", sparsity_profile="owl")
    with pytest.raises(InputError, match="measures the dense model on calibration data"):
        llmq.prune(
            tiny_llama, tmp_path / "o", method="magnitude", sparsity=0.5,
            sparsity_profile="owl", skip_layer_check=True,
        )  # fmt: skip
