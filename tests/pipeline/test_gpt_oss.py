"""GPT-OSS on the layer pipeline (a tiny random GPT-OSS: biased attention with sinks, a sliding
layer, 4 biased experts stored fused): llmq computes what transformers computes, reads each
expert's linears as slices of the fused tensors, and writes quantized experts in GPT-OSS's own
MXFP4 release format, which transformers decodes with its own code to what llmq computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import llmq
from llmq.cli.main import app
from llmq.io.checkpoint import open_checkpoint
from llmq.runtime.load import load_quantized
from tests.conftest import assert_bad_input, make_tiny_gpt_oss
from tests.pipeline.test_moe import logits

EXPERTS = 4
EXPERTS_0 = "model.layers.0.mlp.experts"
CALIBRATION = {"num_samples": 4, "seq_len": 32}
# the hub releases' quantization_config (openai/gpt-oss-20b's config.json)
RELEASE_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """Two layers (sliding window 8 shorter than the 24-token inputs, then full attention), with
    biases and sinks drawn large enough to matter."""
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "gpt_oss", default_model)


def test_llmq_computes_gpt_oss_as_transformers_does(tiny_gpt_oss: Path) -> None:
    theirs = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss, dtype=torch.float32)
    torch.testing.assert_close(logits(llmq.load_dequantized(tiny_gpt_oss)), logits(theirs))


def test_each_expert_reads_as_its_own_linears_sliced_from_the_fused_tensors(
    tiny_gpt_oss: Path,
) -> None:
    stored = load_file(tiny_gpt_oss / "model.safetensors")
    ckpt = open_checkpoint(tiny_gpt_oss)
    assert not any(name.startswith(f"{EXPERTS_0}.gate_up_proj") for name in ckpt.tensors)
    gate_up, down = stored[f"{EXPERTS_0}.gate_up_proj"], stored[f"{EXPERTS_0}.down_proj"]
    gate_up_bias, down_bias = stored[f"{EXPERTS_0}.gate_up_proj_bias"], stored[f"{EXPERTS_0}.down_proj_bias"]  # fmt: skip
    for e in range(EXPERTS):
        expected = {  # gate: the even columns of gate_up [in, 2 x out], up: the odd ones
            "gate_proj.weight": gate_up[e][:, 0::2].T, "up_proj.weight": gate_up[e][:, 1::2].T,
            "down_proj.weight": down[e].T, "gate_proj.bias": gate_up_bias[e][0::2],
            "up_proj.bias": gate_up_bias[e][1::2], "down_proj.bias": down_bias[e],
        }  # fmt: skip
        for leaf, tensor in expected.items():
            name = f"{EXPERTS_0}.{e}.{leaf}"
            assert ckpt.tensors[name].shape == tuple(tensor.shape)
            assert torch.equal(ckpt.read(name), tensor)


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_mxfp4_experts_are_written_as_gpt_oss_releases_them_and_transformers_reads_them(
    tmp_path: Path, tiny_gpt_oss: Path, method: str
) -> None:
    out = tmp_path / method
    calibration = {} if method == "rtn" else CALIBRATION
    result = llmq.quantize(tiny_gpt_oss, out, scheme="mxfp4a16", method=method, **calibration)
    written: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        written.update(load_file(shard))
    source = load_file(tiny_gpt_oss / "model.safetensors")
    assert written[f"{EXPERTS_0}.gate_up_proj_blocks"].shape == (EXPERTS, 256, 6, 16)
    assert written[f"{EXPERTS_0}.gate_up_proj_scales"].shape == (EXPERTS, 256, 6)
    assert written[f"{EXPERTS_0}.down_proj_blocks"].shape == (EXPERTS, 192, 4, 16)
    assert not any(f"{EXPERTS_0}.0." in name for name in written)  # nothing per expert
    kept = ["self_attn.q_proj.weight", "self_attn.o_proj.bias", "self_attn.sinks"]  # 16 bits
    if method != "awq":  # AWQ's scale folds into the MLP's norm and is undone in the router
        kept.append("mlp.router.weight")
    for name in kept:
        assert torch.equal(written[f"model.layers.1.{name}"], source[f"model.layers.1.{name}"])
    assert json.loads((out / "config.json").read_text())["quantization_config"] == RELEASE_CONFIG
    assert result.ignored == ["lm_head", *(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo")]  # fmt: skip
    theirs = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32
    )  # decoded by transformers
    torch.testing.assert_close(logits(theirs), logits(llmq.load_dequantized(out)), rtol=1e-5, atol=1e-5)  # fmt: skip
    if method == "gptq":
        assert all(layer.output_rel_rmse < layer.rtn_output_rel_rmse for layer in result.layers)


def test_a_release_reads_as_mxfp4_linears_runs_on_llmqs_kernels_and_is_not_quantized_again(
    tmp_path: Path, tiny_gpt_oss: Path
) -> None:
    release = tmp_path / "release"
    llmq.quantize(tiny_gpt_oss, release, scheme="mxfp4a16", method="rtn", reference=False)
    ckpt = open_checkpoint(release)
    stored = load_file(next(release.glob("*00002-*.safetensors")))
    blocks = stored[f"{EXPERTS_0}.gate_up_proj_blocks"]
    packed = ckpt.read(f"{EXPERTS_0}.3.up_proj.weight_packed")  # expert 3's odd rows
    assert torch.equal(packed, blocks[3, 1::2].flatten(1))
    assert torch.equal(ckpt.read(f"{EXPERTS_0}.3.up_proj.weight_scale"), stored[f"{EXPERTS_0}.gate_up_proj_scales"][3, 1::2])  # fmt: skip
    on_kernels = load_quantized(ckpt, device="cpu", dtype=torch.float32, kernels="torch")
    torch.testing.assert_close(logits(on_kernels), logits(llmq.load_dequantized(release)), rtol=1e-4, atol=1e-4)  # fmt: skip
    from typer.testing import CliRunner

    again = CliRunner().invoke(app, ["quantize", str(release), "-o", str(tmp_path / "again"), "--scheme", "mxfp4a16"])  # fmt: skip
    assert_bad_input(again, "already quantized (mxfp4)")


def test_pruning_writes_the_experts_fused_with_their_zeros(
    tmp_path: Path, tiny_gpt_oss: Path
) -> None:
    out = tmp_path / "wanda"
    llmq.prune(tiny_gpt_oss, out, method="wanda", sparsity=0.5, reference=False, **CALIBRATION)
    written: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        written.update(load_file(shard))
    gate_up = written[f"{EXPERTS_0}.gate_up_proj"]
    assert gate_up.shape == (EXPERTS, 192, 256)
    assert (gate_up == 0).float().mean().item() == pytest.approx(0.5, abs=0.01)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(theirs), logits(llmq.load_dequantized(out)))


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--scheme", "w4a16"], "use --scheme mxfp4a16"),
        (["--scheme", "mxfp4a16", "--kv-cache", "fp8"], "--kv-cache"),
        (["--scheme", "w4a16", "--target-bits", "4.5"], "use --scheme mxfp4a16"),
        (
            ["--scheme", "mxfp4a16", "--ignore", r"re:.*experts\.1\.down_proj"],
            "every expert of a layer",
        ),
        (["--scheme", "mxfp4a16", "--model-free"], "stores its experts fused"),
    ],
)
def test_what_the_release_format_cannot_hold_is_refused_in_one_line(
    tmp_path: Path, tiny_gpt_oss: Path, options: list[str], fragment: str
) -> None:
    from typer.testing import CliRunner

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(tiny_gpt_oss), "-o", str(out), *options])
    assert_bad_input(result, fragment)
    assert not out.exists()


def test_fallback_scan_groups_the_fused_experts_along_their_inputs(
    tmp_path: Path, tiny_gpt_oss: Path
) -> None:
    """gate_up_proj is stored [E, in, out]: scanned as each expert's linear [E, out, in] (the
    same tensor transposed, in a file without a config, scans identically), not grouped along
    its outputs."""
    name = f"{EXPERTS_0}.gate_up_proj"
    linear_major = tmp_path / "transposed"
    linear_major.mkdir()
    fused = load_file(tiny_gpt_oss / "model.safetensors")[name]
    save_file({name: fused.transpose(1, 2).contiguous()}, linear_major / "experts.safetensors")

    def scanned(path: Path) -> float:
        report = llmq.fallback_scan(path, scheme="mxfp4a16", include=rf"{EXPERTS_0}\.gate_up_proj$")
        [scan] = report.tensors
        return scan.stats.nrmse

    assert scanned(tiny_gpt_oss) == scanned(linear_major)
    as_stored = tmp_path / "as-stored"
    as_stored.mkdir()
    save_file({name: fused}, as_stored / "experts.safetensors")
    assert scanned(as_stored) != scanned(linear_major)
