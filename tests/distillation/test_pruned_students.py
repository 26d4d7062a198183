"""Masks cover the weights llmq prunes, and nothing else: the documented prune -> distill chain
on a tiny model shaped like the default one (Llama, lm_head tied to an embedding with exact
zeros, as SmolLM2's 4-bit origin leaves it), with every student `llmq prune` and `llmq
quantize` write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from llmq.cli.main import app
from llmq.distillation.masks import prunable_linears, pruning_masks
from tests.conftest import assert_bad_input, make_tiny
from tests.distillation.test_distill import FAST_CLI, weights

runner = CliRunner()
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def zeros_in_embedding(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """A tiny tied Llama whose embedding (so also lm_head) holds exact zeros."""
    folder = make_tiny(tmp_path_factory.mktemp("masks") / "model", default_model)
    tensors = load_file(folder / "model.safetensors")
    embed = tensors[EMBED]
    embed[embed.abs() < 0.01] = 0.0  # about 1.6% of it
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_masks_are_the_decoder_linears_by_parameter_name(zeros_in_embedding: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(zeros_in_embedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    linears = prunable_linears(model)
    assert len(linears) == 2 * 7 and all(".layers." in name for name in linears)
    assert set(linears) <= dict(model.named_parameters()).keys()
    assert pruning_masks(model, recorded=True) == {}  # the embedding's zeros are no pruning


@pytest.mark.parametrize(
    "pruning",
    [
        ["--method", "magnitude", "--sparsity", "0.5", "--skip-layer-check"],
        ["--method", "sparsegpt", "--pattern", "2:4", "--num-samples", "4", "--seq-len", "64"],
    ],
    ids=["magnitude-50", "sparsegpt-2of4"],
)
def test_pruned_students_distill_with_zeros_kept_and_lm_head_tied(
    tmp_path: Path, zeros_in_embedding: Path, pruning: list[str]
) -> None:
    model, student, out = zeros_in_embedding, tmp_path / "student", tmp_path / "out"
    pruned = runner.invoke(app, ["prune", str(model), "--out", str(student), *pruning, "--no-reference"])  # fmt: skip
    assert pruned.exit_code == 0, pruned.output
    distill = ["distill", "--teacher", str(model), "--student", str(student), "--out", str(out),
               "--max-steps", "2", "--lr", "1e-2", "--keep", "last", *FAST_CLI]  # fmt: skip
    result = runner.invoke(app, distill)
    assert result.exit_code == 0, result.output
    before, after = weights(student), weights(out)
    assert before.keys() == after.keys() and "lm_head.weight" not in after
    for name, weight in before.items():
        if name.endswith("proj.weight"):
            assert weight.eq(0).float().mean() >= 0.5, name
            assert torch.equal(after[name] == 0, weight == 0), name
            assert not torch.equal(after[name], weight), name  # the rest did train
    # the tied embedding trained as a whole (it was never pruned): its zeros moved too
    assert int((after[EMBED] == 0).sum()) < int((before[EMBED] == 0).sum())
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_a_quantized_student_is_refused_in_one_line(
    tmp_path: Path, zeros_in_embedding: Path
) -> None:
    student = tmp_path / "w8a8"
    quantize = ["quantize", str(zeros_in_embedding), "--out", str(student), "--scheme", "w8a8",
                "--skip-layer-check", "--no-reference"]  # fmt: skip
    assert runner.invoke(app, quantize).exit_code == 0
    distill = ["distill", "--teacher", str(zeros_in_embedding), "--student", str(student),
               "--out", str(tmp_path / "out"), "--max-steps", "2", *FAST_CLI]  # fmt: skip
    assert_bad_input(runner.invoke(app, distill), "the student is quantized")
    assert not (tmp_path / "out").exists()
