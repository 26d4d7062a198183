"""Quantization-aware distillation: the straight-through estimator, and an export whose codes
reproduce the fake-quantized forward exactly (reloaded through the compressed-tensors reader)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from llmq.cli.main import app
from llmq.config import QuantArgs
from llmq.distillation.models import load_model, write_student
from llmq.distillation.qat import (
    apply_qat,
    export,
    fake_quantized,
    fake_quantized_input,
    linear_args,
)
from llmq.io.checkpoint import open_checkpoint
from llmq.io.record import OutputRecord
from llmq.progress import NO_PROGRESS
from llmq.runtime.load import load_dequantized
from tests.conftest import assert_bad_input

runner = CliRunner()


def test_straight_through_gradient_on_a_hand_example() -> None:
    """int4 symmetric per channel: w = [0.7, -0.33, 0.12, 0.26] has scale 0.7 / 7 = 0.1, so the
    forward sees [0.7, -0.3, 0.1, 0.3], and the gradient of sum(c * fq(w)) is c itself, as if
    the rounding were not there."""
    args = QuantArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
    w = torch.tensor([[0.7, -0.33, 0.12, 0.26]], requires_grad=True)
    out = fake_quantized(w, args, torch.float32)
    torch.testing.assert_close(out.detach(), torch.tensor([[0.7, -0.3, 0.1, 0.3]]))
    c = torch.tensor([[1.0, 2.0, -3.0, 0.5]])
    (out * c).sum().backward()
    assert torch.equal(w.grad, c)


def test_fake_quantized_input_is_per_token_int8_with_identity_gradient() -> None:
    """W8A8's inputs: each token scaled by its own absmax / 127. Token [1.27, -0.5, 0.013] has
    scale 0.01, so the forward sees [1.27, -0.5, 0.01]; the gradient passes unchanged."""
    args = QuantArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    x = torch.tensor([[1.27, -0.5, 0.013], [0.0, 0.0, 0.0]], requires_grad=True)
    out = fake_quantized_input(x, args)
    torch.testing.assert_close(out.detach(), torch.tensor([[1.27, -0.5, 0.01], [0.0, 0.0, 0.0]]))
    c = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]])
    (out * c).sum().backward()
    assert torch.equal(x.grad, c)


IDS = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))


def train_like_model(student):
    """The tiny model with its weights moved off any grid, as training leaves them."""
    model = load_model(student, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    return model


def export_trained(model, student, tmp_path, scheme, group_size):
    """The model written in float, then exported as `distill --qat` does; the export's folder
    and its quantization_config."""
    (tmp_path / "float").mkdir()
    record = OutputRecord(source_model=str(student.path))
    write_student(model.state_dict(), student, tmp_path / "float", record, "cpu", reference=False)
    export(tmp_path / "float", tmp_path / "q", scheme, group_size, progress=NO_PROGRESS)
    return tmp_path / "q", json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]  # fmt: skip


@pytest.mark.parametrize(("scheme", "group_size"), [("w4a16", 64), ("w4a16", -1), ("w4a16-asym", 64), ("w8a16", None)])  # fmt: skip
def test_export_reproduces_the_fake_quantized_forward(tmp_path, tiny_llama, scheme, group_size):
    """Train-like weights (the tiny model moved off its grid), the fake-quantized logits, then
    the export: reloaded from the compressed-tensors files, the same logits."""
    student = open_checkpoint(tiny_llama)
    model = train_like_model(student)
    plan = linear_args(student, scheme, group_size)
    assert apply_qat(model, plan) == len(student.decoder_linears)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    folder, config = export_trained(model, student, tmp_path, scheme, group_size)
    assert config["format"] in ("pack-quantized", "int-quantized")
    with torch.no_grad():
        reloaded = load_dequantized(open_checkpoint(folder))(input_ids=IDS).logits
    torch.testing.assert_close(reloaded, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
def test_activation_quantized_export_scores_as_trained(tmp_path, tiny_llama, scheme):
    """W8A8 and FP8: the training forward quantizes every linear's input per token, and llmq's
    evaluator, running the exported checkpoint as its `input_activations` say, computes the same
    log-probabilities; the float model's differ (the inputs' quantization is not a no-op)."""
    from llmq.eval.logits import evaluator_log_probs

    student = open_checkpoint(tiny_llama)
    model = train_like_model(student)
    with torch.no_grad():
        unquantized = model(input_ids=IDS).logits.log_softmax(-1)
    plan = linear_args(student, scheme, None)
    assert all(linear.inputs is not None and linear.inputs.dynamic for linear in plan.values())
    apply_qat(model, plan)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits.log_softmax(-1)
    folder, config = export_trained(model, student, tmp_path, scheme, None)
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    scored = torch.stack(evaluator_log_probs(open_checkpoint(folder), IDS.tolist()))
    torch.testing.assert_close(scored, expected, rtol=0, atol=1e-4)
    assert (unquantized - expected).abs().max() > 1e-3


FAST = {"seq_len": 64, "batch_size": 2, "grad_accum": 2, "eval_windows": 2, "eval_seq_len": 64,
        "evaluate": False, "reference": False}  # fmt: skip


@pytest.mark.slow
def test_qat_distillation_writes_the_scheme_and_resumes_identically(tmp_path, teacher, student):
    """`llmq distill --qat w4a16`: OUT is a pack-quantized checkpoint with the distillation's
    record, the student trains (held-out perplexity of the fake-quantized model falls), and a
    run interrupted after step 2 and resumed writes the same codes as an uninterrupted one."""
    import llmq
    from tests.distillation.test_distill import InterruptAfter, assert_same_weights

    options = {**FAST, "max_steps": 4, "lr": 3e-3, "keep": "last", "eval_every": 4,
               "checkpoint_every": 2, "qat": {"scheme": "w4a16", "group_size": 64}}  # fmt: skip
    whole = llmq.distill(teacher, student, tmp_path / "whole", **options)
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    record = json.loads((tmp_path / "whole" / "llmq.json").read_text())
    assert record["distillation"]["config"]["qat"] == {
        "scheme": "w4a16",
        "group_size": 64,
        "init": "float",
    }
    assert whole.evaluations[-1]["perplexity"] < whole.evaluations[0]["perplexity"]
    with pytest.raises(KeyboardInterrupt):
        llmq.distill(teacher, student, tmp_path / "resumed", progress=InterruptAfter(3), **options)  # fmt: skip
    llmq.distill(teacher, student, tmp_path / "resumed", resume=True, **options)
    assert_same_weights(tmp_path / "whole", tmp_path / "resumed")


def test_w8a8_qat_distillation_writes_what_it_measured(tmp_path, teacher, student):
    """`llmq distill --qat w8a8`: OUT is an int-quantized checkpoint with dynamic per-token
    inputs, and `llmq eval` scores it (activations quantized as the file says) with the held-out
    perplexity training measured on the fake-quantized student it kept."""
    import llmq

    options = {
        **FAST,
        "max_steps": 2,
        "lr": 3e-3,
        "keep": "last",
        "eval_every": 2,
        "qat": {"scheme": "w8a8"},
    }
    result = llmq.distill(teacher, student, tmp_path / "out", **options)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized"
    kept = next(e for e in result.evaluations if e["step"] == result.kept_step)
    measured = llmq.evaluate(tmp_path / "out", seq_len=64, max_windows=2, use_cache=False)
    assert measured.model.perplexity == pytest.approx(kept["perplexity"], rel=1e-4)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (
            ["--qat", "w5a16"],
            "qat.scheme: Input should be 'w4a16', 'w4a16-asym', 'w8a16', 'w8a8' or 'fp8'",
        ),
        (["--qat-group-size", "64"], "--qat-group-size: goes with --qat"),
        (
            ["--qat", "w4a16", "--qat-group-size", "24"],
            "qat: group_size 24 is not -1 or a power of two >= 16",
        ),
    ],
)
def test_bad_qat_options_are_refused_in_one_line(tmp_path, teacher, student, options, fragment):
    result = runner.invoke(
        app, ["distill", "--teacher", str(teacher), "--student", str(student), "--out",
              str(tmp_path / "o"), "--max-steps", "1", *options],
    )  # fmt: skip
    assert_bad_input(result, fragment)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_qat_init_starts_from_the_methods_solution(tmp_path, teacher, student, method) -> None:
    """With a learning rate too small to move a weight, the run's export is the method's
    checkpoint: the same packed words (up to groups whose extreme took the code -8, rescaled
    from the weights), far from RTN's; and its folder is neither published nor left behind."""
    from safetensors.torch import load_file

    import llmq

    options = {**FAST, "max_steps": 1, "lr": 1e-12, "keep": "last",
               "qat": {"scheme": "w4a16", "group_size": 64, "init": method}}  # fmt: skip
    llmq.distill(teacher, student, tmp_path / "qat", **options)
    llmq.quantize(student, tmp_path / method, scheme="w4a16", group_size=64, method=method)
    llmq.quantize(student, tmp_path / "rtn", scheme="w4a16", group_size=64, method="rtn")

    def words(folder):
        found = {}
        for path in sorted(folder.glob("*.safetensors")):
            found.update({k: v for k, v in load_file(path).items() if k.endswith("weight_packed")})
        return found

    def agreement(a, b):
        same = sum(int((a[k] == b[k]).sum()) for k in a)
        return same / sum(a[k].numel() for k in a)

    qat, ptq, rtn = words(tmp_path / "qat"), words(tmp_path / method), words(tmp_path / "rtn")
    assert agreement(qat, ptq) > 0.95 > agreement(qat, rtn)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([method, "qat", "rtn"])
