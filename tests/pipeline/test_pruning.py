"""Pruned and quantized in one pass (magnitude, Wanda, SparseGPT) through quantize's layer
pipeline: the sparsity written, zeros kept exactly by every scheme, a checkpoint that plain
transformers reloads, and bad input refused before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.io.checkpoint import open_checkpoint
from llmq.pack.reader import QuantizedView
from tests.conftest import assert_bad_input

runner = CliRunner()
CALIB = {"num_samples": 4, "seq_len": 64}


def written_weights(out: Path) -> dict[str, torch.Tensor]:
    """Every quantized linear's weight as the checkpoint stores it, dequantized."""
    ckpt = open_checkpoint(out)
    view = QuantizedView(ckpt)
    weights = {}
    for index in range(ckpt.num_layers):
        prefix = ckpt.layout.layer_prefix(index)
        for name, tensor in view.read_state(ckpt, prefix).items():
            if name.endswith("proj.weight"):
                weights[prefix + name] = tensor
    return weights


@pytest.mark.parametrize(
    ("method", "scheme", "target"),
    [
        ("magnitude", "w4a16-asym", {"sparsity": 0.5}),
        ("wanda", "w8a8", {"pattern": "2:4"}),
        ("sparsegpt", "w4a16", {"sparsity": 0.5}),
        ("sparsegpt", "fp8", {"pattern": "2:4"}),
    ],
)
def test_pruned_checkpoints_keep_their_zeros_and_reload(
    tmp_path: Path, tiny_llama: Path, method: str, scheme: str, target: dict
) -> None:
    out = tmp_path / "out"
    extra = {"skip_layer_check": True} if method == "magnitude" else CALIB
    result = llmq.quantize(tiny_llama, out, scheme=scheme, method=method, **target, **extra)
    for name, weight in written_weights(out).items():
        zeros = weight == 0
        if "pattern" in target:
            assert torch.all(zeros.reshape(weight.shape[0], -1, 4).sum(-1) >= 2), name
        else:
            assert torch.all(zeros.sum(1) >= weight.shape[1] // 2), name
    reports = [linear for layer in result.layers for linear in layer.linears]
    assert all(0.5 <= linear.sparsity < 0.6 for linear in reports)
    loaders = ["llmq"] if scheme.endswith("asym") else ["transformers", "llmq"]  # see verify
    verified = llmq.verify(out, loaders=loaders)
    assert verified.passed, [row.detail for row in verified.loaders]


def test_sparsegpt_beats_magnitude_on_the_layer_outputs(tmp_path: Path, tiny_llama: Path) -> None:
    errors = {}
    for method in ("magnitude", "sparsegpt"):
        result = llmq.quantize(
            tiny_llama, tmp_path / method, scheme="w8a16", method=method, sparsity=0.5, **CALIB
        )
        errors[method] = [layer.output_rel_rmse for layer in result.layers]
    assert all(s < m for s, m in zip(errors["sparsegpt"], errors["magnitude"], strict=True))


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--method", "magnitude", "--sparsity", "1.2"], "sparsity: Input should be less than 1"),
        (["--method", "magnitude", "--sparsity", "0"], "sparsity: Input should be greater than 0"),
        (["--method", "wanda", "--pattern", "3:2"], "N:M needs 0 < N < M"),
        (["--method", "wanda", "--pattern", "2:5"], "5 does not divide in_features 192"),
        (["--method", "sparsegpt", "--sparsity", "0.5", "--pattern", "2:4"], "not both"),
        (["--method", "sparsegpt"], "give either sparsity or pattern"),
        (["--method", "rtn", "--sparsity", "0.5"], "prunes only with method"),
        (["--method", "sparsegpt", "--sparsity", "0.5", "--skip-layer-check"], "needs calibration data"),
    ],
)  # fmt: skip
def test_bad_pruning_options_exit_2_before_any_work(
    tmp_path: Path, tiny_llama: Path, options: list[str], fragment: str
) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["quantize", str(tiny_llama), "--out", str(out), *options])
    assert_bad_input(result, fragment)
    assert list(tmp_path.iterdir()) == []
