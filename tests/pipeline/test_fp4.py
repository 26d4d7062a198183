"""FP4 and MX checkpoints end to end: written by the layer pipeline (and model-free where it
may), loaded by transformers (compressed-tensors' decompressors) and by llmq's evaluator with
the recorded logits; NVFP4 gives the linears vLLM fuses one global scale; bad input is one
line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.quant.floats import nvfp4_global_scale
from tests.conftest import assert_bad_input, make_tiny

FP4_SCHEMES = ["nvfp4a16", "nvfp4", "mxfp4a16", "mxfp4", "mxfp8"]


def stored(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("scheme", FP4_SCHEMES)
def test_fp4_checkpoints_load_in_transformers_and_llmq_with_the_recorded_logits(
    tmp_path: Path, tiny_llama: Path, scheme: str
) -> None:
    """transformers reads exactly llmq's weights (NVFP4's power-of-two global scale keeps its
    bfloat16 decompression exact); llmq's evaluator runs the format, activations included."""
    out = tmp_path / scheme
    llmq.quantize(tiny_llama, out, scheme=scheme, num_samples=2, seq_len=32)
    result = llmq.verify(out, loaders=["transformers", "llmq"])
    assert {row.loader: row.status for row in result.loaders} == {"transformers": "ok", "llmq": "ok"}  # fmt: skip
    transformers = result.loaders[0].comparison
    assert transformers.reference == "weights alone" and transformers.distance.max_abs < 1e-4


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_calibrated_methods_on_the_fp4_grids_beat_rtn(
    tmp_path: Path, tiny_llama: Path, scheme: str, method: str
) -> None:
    """GPTQ and AWQ run on the E2M1 grid (scales in the format's types) and lose less of every
    layer's output than RTN on the calibration data; the checkpoint verifies."""
    out = tmp_path / method
    result = llmq.quantize(tiny_llama, out, scheme=scheme, method=method, num_samples=4, seq_len=64)
    for layer in result.layers:
        assert layer.output_rel_rmse < layer.rtn_output_rel_rmse
    verified = llmq.verify(out, loaders=["transformers", "llmq"])
    assert verified.passed, [row.detail for row in verified.loaders]


def test_nvfp4_fused_linears_share_one_global_scale(tmp_path: Path, tiny_llama: Path) -> None:
    """q/k/v (vLLM's qkv_proj) and gate/up (gate_up_proj) each get one weight_global_scale,
    the set's (from its largest weight); o_proj and down_proj their own."""
    out = tmp_path / "nvfp4"
    result = llmq.quantize(tiny_llama, out, scheme="nvfp4a16", reference=False)
    assert result.model_free is not None  # each set stacked from the files, as the layers stack it
    files = stored(out)
    original = stored(tiny_llama)
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):  # fmt: skip
            scales = {float(files[f"{prefix}{name}.weight_global_scale"]) for name in fused}
            assert len(scales) == 1
            absmax = max(float(original[f"{prefix}{name}.weight"].float().abs().max()) for name in fused)  # fmt: skip
            assert scales == {float(nvfp4_global_scale(absmax))}
        for alone in ("self_attn.o_proj", "mlp.down_proj"):
            absmax = float(original[f"{prefix}{alone}.weight"].float().abs().max())
            assert float(files[f"{prefix}{alone}.weight_global_scale"]) == float(
                nvfp4_global_scale(absmax)
            )


def test_nvfp4_experts_share_one_global_scale_per_gate_and_up(
    tmp_path: Path, default_model: Path
) -> None:
    """A mixture of experts (Qwen3-MoE): each expert's gate and up share a global scale (vLLM's
    w13), computed from that expert alone, calibrated (every expert on every token: one input
    for all of them) or not; an expert's down_proj keeps its own."""
    source = make_tiny(tmp_path / "moe", default_model, model_type="qwen3_moe")
    original = stored(source)
    for run, options in (("rtn", {"skip_layer_check": True}), ("gptq", {"method": "gptq", "num_samples": 2, "seq_len": 32})):  # fmt: skip
        llmq.quantize(source, tmp_path / run, scheme="nvfp4a16", reference=False, **options)
        files = stored(tmp_path / run)
        for expert in range(4):
            prefix = f"model.layers.1.mlp.experts.{expert}."
            pair = [f"{prefix}{name}" for name in ("gate_proj", "up_proj")]
            absmax = max(float(original[f"{name}.weight"].float().abs().max()) for name in pair)
            for name in pair:
                assert float(files[f"{name}.weight_global_scale"]) == _global(absmax), (run, name)
            down = float(original[f"{prefix}down_proj.weight"].float().abs().max())
            assert float(files[f"{prefix}down_proj.weight_global_scale"]) == _global(down)


def _global(absmax: float) -> float:
    return float(nvfp4_global_scale(absmax))


def test_nvfp4_inputs_get_a_calibrated_global_scale(tmp_path: Path, tiny_llama: Path) -> None:
    """NVFP4 activations: per 16 at run time, under a global scale from the calibration
    inputs' range, stored as compressed-tensors' input_global_scale; a power of two."""
    out = tmp_path / "nvfp4"
    result = llmq.quantize(tiny_llama, out, scheme="nvfp4", num_samples=2, seq_len=32)
    assert result.calibration is not None and result.model_free is None
    files = stored(out)
    scales = {name: t for name, t in files.items() if name.endswith(".input_global_scale")}
    assert len(scales) == 14  # every decoder linear of the two layers
    for scale in scales.values():
        assert scale.dtype == torch.float32 and scale.shape == (1,)
        assert float(scale) == 2.0 ** round(float(torch.log2(scale)))


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--scheme", "nvfp4", "--group-size", "32"], "group_size 32: nvfp4 g16 weights"),
        (["--scheme", "mxfp4", "--activations", "static"], "activations static: mxfp4"),
        (["--scheme", "nvfp4", "--skip-layer-check"], "NVFP4's input global scales"),
    ],
)
def test_bad_fp4_input_is_one_line(
    tmp_path: Path, tiny_llama: Path, flags: list[str], fragment: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "--out", str(out), *flags])
    assert_bad_input(result, fragment)
    assert not out.exists()


def test_fallback_auto_holds_fp4_to_int4s_threshold(tmp_path: Path, tiny_llama: Path) -> None:
    """`--fallback auto` scans with the FP4 grid and int4's NRMSE threshold: the tiny model's
    Gaussian-like linears pass (an FP8 threshold would keep every one in full precision)."""
    result = llmq.quantize(
        tiny_llama, tmp_path / "out", scheme="mxfp4a16", fallback="auto", skip_layer_check=True
    )
    assert result.fallback is not None and result.fallback["kept"] == []
    assert result.fallback["scheme"] == "mxfp4 g32"


def test_a_width_the_format_cannot_group_is_one_line(tmp_path: Path, default_model: Path) -> None:
    """hidden 200 is a multiple of 8 but not of MX's groups of 32: refused before any work,
    naming the format and the width, with --ignore as the way out; nothing written."""
    source = make_tiny(tmp_path / "odd", default_model, hidden=200, heads=5, kv_heads=1)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(source), "--out", str(out), "--scheme", "mxfp4a16"])  # fmt: skip
    assert_bad_input(result, "mxfp4 g32: in_features 200 is not a multiple of the format's groups of 32")  # fmt: skip
    assert not out.exists()
