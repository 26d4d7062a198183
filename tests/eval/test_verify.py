"""`llmq verify`: each installed loader loads the checkpoint and reproduces the recorded
reference, or the failure is named in one line; tampered files are caught."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.errors import InputError
from tests.conftest import assert_bad_input

runner = CliRunner()


@pytest.fixture(scope="module")
def symmetric(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    out = tmp_path_factory.mktemp("verify") / "w4a16"
    llmq.quantize(tiny_llama, out, scheme="w4a16", group_size=64, skip_layer_check=True)
    return out


def verdicts(result) -> dict[str, str]:
    return {row.loader: row.status for row in result.loaders}


def test_a_symmetric_checkpoint_loads_everywhere_with_the_recorded_logits(symmetric: Path) -> None:
    result = llmq.verify(symmetric, loaders=["transformers", "llmq"])
    assert verdicts(result) == {"transformers": "ok", "llmq": "ok"}
    assert result.passed and result.changed_files == []
    for row in result.loaders:  # float32 in both: the same numbers, far inside the tolerance
        assert row.comparison.distance.max_abs < 1e-3
    record = json.loads((symmetric / "llmq.json").read_text())
    assert record["loaders"]["transformers"] == {"reads": True, "why": None}
    cli = runner.invoke(app, ["verify", str(symmetric), "--loader", "transformers,llmq"])
    assert cli.exit_code == 0 and "PASS" in cli.output


def test_asymmetric_int4_fails_in_transformers_in_one_line_and_loads_in_llmq(
    tmp_path: Path, tiny_llama: Path
) -> None:
    out = tmp_path / "asym"
    quantized = llmq.quantize(tiny_llama, out, scheme="w4a16-asym", group_size=64, skip_layer_check=True)  # fmt: skip
    assert quantized.loaders["transformers"]["reads"] is False  # said at quantize time
    assert "zero points are stored packed" in quantized.loaders["transformers"]["why"]
    result = llmq.verify(out, loaders=["transformers", "llmq"])
    assert verdicts(result) == {"transformers": "does not load", "llmq": "ok"}
    reason = result.loaders[0].detail
    assert "\n" not in reason and "weight_zero_point" in reason and "mismatch" in reason
    cli = runner.invoke(app, ["verify", str(out), "--loader", "transformers,llmq", "--json"])
    assert cli.exit_code == 1 and json.loads(cli.stdout)["passed"] is False


def test_a_tampered_scale_is_caught_as_wrong_logits(tmp_path: Path, symmetric: Path) -> None:
    out = tmp_path / "tampered"
    shutil.copytree(symmetric, out)
    name = "model.layers.1.mlp.down_proj.weight_scale"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard = out / index[name]
    tensors = load_file(shard)
    tensors[name] *= 1.5  # the scales of one linear
    save_file(tensors, shard, metadata={"format": "pt"})
    result = llmq.verify(out, loaders=["transformers", "llmq"])
    assert verdicts(result) == {"transformers": "wrong logits", "llmq": "wrong logits"}
    assert result.changed_files == [shard.name] and not result.passed


def test_activation_quantized_checkpoints_compare_weights_alone_and_as_run(
    tmp_path: Path, tiny_llama: Path
) -> None:
    out = tmp_path / "w8a8"
    llmq.quantize(tiny_llama, out, scheme="w8a8", skip_layer_check=True)
    reference = json.loads((out / "llmq.json").read_text())["reference"]
    assert reference["weights_only"] is not None and reference["activation_effect"] > 0
    result = llmq.verify(out, loaders=["transformers", "llmq"])
    assert verdicts(result) == {"transformers": "ok", "llmq": "ok"}
    transformers, kernels = (row.comparison for row in result.loaders)
    assert transformers.reference == "weights alone" and transformers.distance.max_abs < 1e-3
    assert kernels.reference == "as the format runs" and kernels.tolerance > transformers.tolerance


def test_without_a_record_the_reference_is_computed_now(tmp_path: Path, symmetric: Path) -> None:
    out = tmp_path / "bare"
    shutil.copytree(symmetric, out)
    (out / "llmq.json").unlink()  # another tool's checkpoint, or an older llmq's
    result = llmq.verify(out, loaders=["llmq"])
    assert result.passed and result.changed_files is None
    assert result.reference.startswith("computed now")


def test_against_the_original_reports_the_distance(symmetric: Path, tiny_llama: Path) -> None:
    result = llmq.verify(symmetric, loaders=["llmq"], against=tiny_llama)
    assert result.against["model"] == str(tiny_llama) and result.against["max_abs"] > 0


def test_bad_input_exits_2(tmp_path: Path, tiny_llama: Path, symmetric: Path) -> None:
    assert_bad_input(runner.invoke(app, ["verify", str(tmp_path / "nothing")]), "nothing")
    assert_bad_input(runner.invoke(app, ["verify", str(tiny_llama)]), "not a quantized checkpoint")
    assert_bad_input(
        runner.invoke(app, ["verify", str(symmetric), "--loader", "onnx"]), "unknown loader 'onnx'"
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_asking_for_an_absent_loader_is_bad_input(symmetric: Path) -> None:
    with pytest.raises(InputError, match="vllm is not installed"):
        llmq.verify(symmetric, loaders=["vllm"])


def test_require_loader_refuses_before_any_work(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "asym"
    result = runner.invoke(
        app, ["quantize", str(tiny_llama), "--out", str(out), "--scheme", "w4a16-asym", "--require-loader", "transformers"]
    )  # fmt: skip
    assert_bad_input(result, "transformers cannot load int4 g128 asym weights")
    assert list(tmp_path.iterdir()) == []
    llmq.quantize(tiny_llama, out, scheme="w4a16", skip_layer_check=True, require_loaders=["transformers"])  # fmt: skip
    assert (out / "config.json").is_file()


def test_the_reference_is_what_the_written_files_compute(symmetric: Path) -> None:
    """The recorded top tokens are the evaluator's on the published folder, exactly."""
    from llmq.eval.logits import Reference, compute_reference
    from llmq.io.checkpoint import open_checkpoint

    recorded = Reference.from_dict(json.loads((symmetric / "llmq.json").read_text())["reference"])
    now = compute_reference(open_checkpoint(symmetric))
    assert [p.top_ids for p in now.prompts] == [p.top_ids for p in recorded.prompts]
    for a, b in zip(now.prompts, recorded.prompts, strict=True):
        torch.testing.assert_close(torch.tensor(a.top_logprobs), torch.tensor(b.top_logprobs))


@pytest.mark.integration
def test_one_group_scale_of_the_default_model_is_caught(
    tmp_path: Path, default_model: Path
) -> None:
    """On a real model one group's scale of one linear (64 of 135M weights) moves the recorded
    log-probabilities by about 0.08, four times the tolerance."""
    out = tmp_path / "w4a16"
    llmq.quantize(default_model, out, scheme="w4a16", group_size=64, skip_layer_check=True)
    name = "model.layers.10.mlp.down_proj.weight_scale"
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name][5, 3] *= 2
    save_file(tensors, shard, metadata={"format": "pt"})
    result = llmq.verify(out, loaders=["transformers", "llmq"])
    assert verdicts(result) == {"transformers": "wrong logits", "llmq": "wrong logits"}


def test_no_reference_still_records_file_hashes(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "plain"
    llmq.quantize(tiny_llama, out, scheme="w8a16", skip_layer_check=True, reference=False)
    assert "reference" not in json.loads((out / "llmq.json").read_text())
    result = llmq.verify(out, loaders=["llmq"])
    assert result.passed and result.changed_files == []
    assert result.reference.startswith("computed now")


def test_vllm_outputs_are_read_at_the_right_positions(symmetric: Path) -> None:
    """vLLM's outputs, built from the reference's own full log-probabilities in vLLM's layout
    (prompt_logprobs shifted by one, the last position in the generated token's logprobs, the
    top 16 only), compare at distance 0; shifted by one position they are wrong logits."""
    from types import SimpleNamespace

    from llmq.eval.logits import (
        LOGPROB_TOLERANCE,
        distance_on_top,
        evaluator_log_probs,
        recorded_reference,
    )
    from llmq.eval.verify import vllm_top_values
    from llmq.io.checkpoint import open_checkpoint
    from llmq.io.record import OutputRecord

    reference = recorded_reference(OutputRecord.read(symmetric), symmetric)
    full = evaluator_log_probs(open_checkpoint(symmetric), reference.input_ids)

    def top(values: torch.Tensor) -> dict[int, SimpleNamespace]:
        best = values.topk(16)
        return {int(i): SimpleNamespace(logprob=float(v)) for v, i in zip(best.values, best.indices, strict=True)}  # fmt: skip

    def output(values: torch.Tensor, shift: int = 0) -> SimpleNamespace:
        rows = [top(row) for row in values.roll(shift, dims=0)]
        return SimpleNamespace(prompt_logprobs=[None, *rows[:-1]], outputs=[SimpleNamespace(logprobs=[rows[-1]])])  # fmt: skip

    aligned = vllm_top_values(reference, [output(v) for v in full])
    assert distance_on_top(reference.prompts, aligned).max_abs < 1e-6
    shifted = vllm_top_values(reference, [output(v, shift=1) for v in full])
    assert distance_on_top(reference.prompts, shifted).max_abs > LOGPROB_TOLERANCE
