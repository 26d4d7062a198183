"""Dense families beyond Llama's names on the layer pipeline: Gemma 3 and Gemma 2 (four norms a
layer, norms of (1 + weight), scaled embeddings, sliding-window layers, Gemma 2's capped logits)
and Phi-3 (q/k/v and gate/up fused in one linear each). Every method writes a checkpoint that
plain transformers reloads to the logits of llmq's own reference, and calibrated methods do
what they are for on these layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import llmq
from llmq.errors import InputError
from tests.conftest import make_tiny
from tests.pipeline.test_quantize import logits_with_activation_quantization

IDS = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(0))
# Calibration windows of 32 tokens: longer than the sliding window, so sliding layers are
# calibrated with their window applied.
FAST = {"num_samples": 4, "seq_len": 32, "reference": False}
SLIDING = {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
FAMILIES = {
    "gemma3_text": SLIDING,
    "gemma2": {**SLIDING, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    "phi3": {"sliding_window": 16},
}
JOBS = {
    "rtn-w4a16": {"scheme": "w4a16"},
    "gptq-w4a16": {"scheme": "w4a16", "method": "gptq"},
    "awq-w4a16": {"scheme": "w4a16", "method": "awq"},
    "fp8": {"scheme": "fp8"},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_dense(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model: Path
) -> Path:
    family = request.param
    folder = tmp_path_factory.mktemp("dense") / family
    return make_tiny(folder, default_model, model_type=family, kv_heads=3, **FAMILIES[family])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_method_reloads_in_transformers(tmp_path: Path, tiny_dense: Path, job: str) -> None:
    out = tmp_path / job
    llmq.quantize(tiny_dense, out, **JOBS[job], **FAST)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = logits_with_activation_quantization(out, IDS)  # FP8 inputs too, as the format says
    torch.testing.assert_close(logits(theirs), ours, rtol=1e-5, atol=1e-5)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"


def test_gptq_beats_rtn_in_every_layer(tmp_path: Path, tiny_dense: Path) -> None:
    result = llmq.quantize(tiny_dense, tmp_path / "gptq", scheme="w4a16", method="gptq", **FAST)
    for layer in result.layers:
        assert layer.output_rel_rmse < layer.rtn_output_rel_rmse
    calibration = json.loads((tmp_path / "gptq" / "llmq.json").read_text())["calibration"]
    assert "moe_calibration" not in calibration  # a dense model routes nothing


def test_awq_scales_reduce_the_error_through_the_norms_and_fusions(
    tmp_path: Path, tiny_dense: Path
) -> None:
    result = llmq.quantize(tiny_dense, tmp_path / "awq", scheme="w4a16", method="awq", **FAST)
    for layer in result.layers:
        assert layer.scales and all(report.error_reduction >= 0 for report in layer.scales)
        assert layer.output_rel_rmse < layer.rtn_output_rel_rmse


def test_structured_pruning_refuses_these_families_in_one_line(
    tmp_path: Path, tiny_dense: Path
) -> None:
    with pytest.raises(InputError, match="structured pruning cannot slice"):
        llmq.prune_structured(tiny_dense, tmp_path / "narrow", num_layers=1, evaluate=False)
    assert list(tmp_path.iterdir()) == []
