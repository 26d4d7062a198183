"""AWQ and SmoothQuant folding on real decoder layers: outputs unchanged before quantization,
statistics rescaled exactly, pairings from the family table only where the shapes allow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmq.calib.collect import run_observed
from llmq.calib.stream import LayerStream
from llmq.config import AWQConfig, QuantArgs
from llmq.io.checkpoint import open_checkpoint
from llmq.pipeline.scaling import apply_awq, apply_smoothquant
from tests.conftest import make_tiny

INT4_G64 = QuantArgs(num_bits=4, strategy="group", group_size=64)


def fold_layer(model: Path) -> tuple[torch.Tensor, torch.Tensor, list, dict, dict]:
    stream = LayerStream(open_checkpoint(model), device="cpu")
    hidden = torch.randn(
        2, 48, stream.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    layer = stream.load_layer(0)
    layout = stream.layout_of(layer)
    names = list(layout.linears)
    reference, stats = run_observed(stream, layer, names, hidden, hessian=True)
    args = dict.fromkeys(names, INT4_G64)
    dtypes = dict.fromkeys(names, torch.float32)
    scaled_stats, reports = apply_awq(layer, layout, args, dtypes, stats, AWQConfig())
    folded, observed = run_observed(stream, layer, names, hidden, hessian=True)
    return reference, folded, reports, scaled_stats, observed


def randomize_norms(model: Path) -> None:
    """Norm weights and biases away from their initial ones and zeros, as trained models have
    them, so that a fold that forgets an offset or a bias shows."""
    tensors = load_file(model / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if "norm" in name and tensor.ndim == 1:
            tensor += 0.2 * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


LLAMA_PAIRS = ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"]
GEMMA_PAIRS = ["input_layernorm", "pre_feedforward_layernorm", "mlp.up_proj"]


@pytest.mark.parametrize(
    "model_type,kv_heads,producers",
    [
        # v_proj -> o_proj only where v's width is o's input width (no GQA)
        ("llama", 3, ["input_layernorm", "self_attn.v_proj", *LLAMA_PAIRS[1:]]),
        ("qwen3", 1, LLAMA_PAIRS),
        ("mistral", 1, LLAMA_PAIRS),
        # Gemma: the MLP reads its own pre-norm, of (1 + weight): folding must divide (1 + g)
        ("gemma3_text", 3, ["input_layernorm", "self_attn.v_proj", *GEMMA_PAIRS[1:]]),
        ("gemma2", 1, GEMMA_PAIRS),
        # Phi-3: fused qkv and gate_up; scales fold into v's and up's rows of the fusion (v's
        # only without GQA)
        (
            "phi3",
            3,
            [
                "input_layernorm",
                "self_attn.qkv_proj",
                "post_attention_layernorm",
                "mlp.gate_up_proj",
            ],
        ),
        ("phi3", 1, ["input_layernorm", "post_attention_layernorm", "mlp.gate_up_proj"]),
        # DeepSeek-V3's latent attention (its first layer, dense): the low-rank norms take
        # scales too
        (
            "deepseek_v3",
            3,
            [
                "input_layernorm",
                "self_attn.q_a_layernorm",
                "self_attn.kv_a_layernorm",
                *LLAMA_PAIRS[1:],
            ],
        ),
        # layouts found from the module tree: a LayerNorm's bias is scaled with its weight
        # (GPT-NeoX), and one of (1 + weight) with a bias (Nemotron)
        ("gpt_neox", 3, ["input_layernorm", "post_attention_layernorm"]),
        ("nemotron", 3, ["input_layernorm", "post_attention_layernorm"]),
    ],
)
def test_folding_preserves_the_layer_output(
    tmp_path: Path, default_model: Path, model_type: str, kv_heads: int, producers: list[str]
) -> None:
    model = make_tiny(
        tmp_path / model_type, default_model, model_type=model_type, layers=1,
        kv_heads=kv_heads, pad_token_id=0,
    )  # fmt: skip
    randomize_norms(model)
    reference, folded, reports, scaled, observed = fold_layer(model)
    assert float((folded - reference).abs().max() / reference.abs().max()) < 1e-5
    assert [r.producer for r in reports] == producers
    for name, stats in scaled.items():  # the rescaled statistics are those of the folded inputs
        assert torch.allclose(
            stats.hessian,
            observed[name].hessian,
            rtol=1e-4,
            atol=1e-6 * float(observed[name].hessian.abs().max()),
        )


@pytest.mark.integration
def test_folding_preserves_the_real_model_layer(default_model: Path) -> None:
    reference, folded, reports, _, _ = fold_layer(default_model)
    assert float((folded - reference).abs().max() / reference.abs().max()) < 1e-5
    assert any(r.error_reduction > 0 for r in reports)


W8 = QuantArgs(num_bits=8, strategy="channel")
A8 = QuantArgs(num_bits=8, strategy="token", dynamic=True)


def smooth_layer(
    model: Path, smooth: float | str
) -> tuple[torch.Tensor, torch.Tensor, list, dict, dict]:
    stream = LayerStream(open_checkpoint(model), device="cpu")
    hidden = torch.randn(
        2, 48, stream.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    layer = stream.load_layer(0)
    names = list(stream.layout.linears)
    reference, stats = run_observed(stream, layer, names, hidden, hessian=False, samples=True)
    scaled, reports = apply_smoothquant(
        layer, stream.layout, dict.fromkeys(names, W8), dict.fromkeys(names, torch.float32),
        dict.fromkeys(names, A8), stats, smooth,
    )  # fmt: skip
    folded, observed = run_observed(stream, layer, names, hidden, hessian=False, samples=True)
    return reference, folded, reports, scaled, observed


@pytest.mark.parametrize("smooth", [0.5, 1.0, "auto"])
@pytest.mark.parametrize("model_type,kv_heads", [("llama", 3), ("qwen3", 1)])
def test_smoothquant_preserves_the_layer_output(
    tmp_path: Path, default_model: Path, model_type: str, kv_heads: int, smooth: float | str
) -> None:
    model = make_tiny(
        tmp_path / model_type, default_model, model_type=model_type, layers=1, kv_heads=kv_heads
    )
    reference, folded, reports, scaled, observed = smooth_layer(model, smooth)
    assert float((folded - reference).abs().max() / reference.abs().max()) < 1e-5
    expected = ["input_layernorm", "post_attention_layernorm"]
    if kv_heads == 3:  # v_proj -> o_proj only where the widths match
        expected.insert(1, "self_attn.v_proj")
    if smooth == "auto":  # a fixed alpha leaves up_proj -> down_proj alone; auto searches it
        expected.append("mlp.up_proj")
    assert [r.producer for r in reports] == expected
    if smooth != "auto":
        assert all(r.alpha == smooth for r in reports)
    for name, stats in scaled.items():  # absmax and samples of the folded inputs, exactly
        torch.testing.assert_close(stats.absmax, observed[name].absmax, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(stats.samples, observed[name].samples, rtol=1e-4, atol=1e-6)


@pytest.mark.integration
def test_smoothquant_on_the_real_model_layer(default_model: Path) -> None:
    """alpha 0.5 on SmolLM2's first layer: the output is unchanged and the W8A8 error of the
    consumers falls where activation outliers dominate (reported per pairing)."""
    reference, folded, reports, _, _ = smooth_layer(default_model, 0.5)
    assert float((folded - reference).abs().max() / reference.abs().max()) < 1e-5
    assert any(r.error_reduction > 0 for r in reports)
