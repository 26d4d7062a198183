"""Mixtures of experts on the layer pipeline (tiny random Qwen3-MoE, OLMoE, Qwen2-MoE with its
shared expert, and Mixtral, whose checkpoint names differ from transformers' modules): llmq
computes what transformers computes, every expert is calibrated on every token, and every expert
is written packed under the name the checkpoint gives it, which transformers reads back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import llmq
from llmq.calib.collect import run_observed
from llmq.calib.stream import LayerStream
from llmq.errors import InputError, UnsupportedModelError
from llmq.io.checkpoint import open_checkpoint
from llmq.io.family import FAMILY_LAYOUT
from llmq.io.layout import Experts
from tests.conftest import TINY_EXPERTS, make_tiny

EXPERTS = 4
assert all(FAMILY_LAYOUT[t].experts.count(f) == EXPERTS for t, f in TINY_EXPERTS.items())  # type: ignore[union-attr]
ROLES = ("gate", "up", "down")
IDS = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=sorted(TINY_EXPERTS))
def tiny_moe(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model: Path
) -> Path:
    family = request.param
    return make_tiny(tmp_path_factory.mktemp("moe") / family, default_model, model_type=family)


def names(model: Path) -> Experts:
    """The family's names for its experts, router and shared expert."""
    experts = open_checkpoint(model).layout.experts
    assert experts is not None
    return experts


def expert(model: Path, e: int, role: str) -> str:
    return names(model).linear(role).replace("*", str(e))


def expert_layers(model: Path) -> list[int]:
    """The layers with experts (DeepSeek-V3's first layer has a plain MLP)."""
    ckpt = open_checkpoint(model)
    return [i for i in range(ckpt.num_layers) if ckpt.layout.at(i).experts is not None]


def routers(model: Path) -> list[str]:
    """The modules kept in 16 bits that weigh experts: the router, a shared expert's gate."""
    found = names(model)
    return [found.router, *([found.shared_gate] if found.shared_gate else [])]


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_llmq_computes_the_experts_as_transformers_does(tiny_moe: Path) -> None:
    theirs = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    torch.testing.assert_close(logits(llmq.load_dequantized(tiny_moe)), logits(theirs))


def test_every_expert_sees_every_calibration_token(tiny_moe: Path) -> None:
    """Its gate and up read the layer's normed input (one statistic for all of them); its down
    reads its own intermediate activations, of all tokens, whatever the router picked."""
    ckpt = open_checkpoint(tiny_moe)
    stream = LayerStream(ckpt)
    layer = stream.load_layer(expert_layers(tiny_moe)[0])
    names = stream.layout_of(layer).linears
    hidden = stream.embed(IDS)
    _, stats = run_observed(stream, layer, list(names), hidden, hessian=True)
    tokens = IDS.numel()
    downs = [stats[expert(tiny_moe, e, "down")] for e in range(EXPERTS)]
    assert all(s.num_tokens == tokens for s in downs)
    assert len({id(s) for s in downs}) == EXPERTS  # each down its own input
    ins = {id(stats[expert(tiny_moe, e, role)]) for e in range(EXPERTS) for role in ("gate", "up")}  # fmt: skip
    assert len(ins) == 1 and stats[expert(tiny_moe, 0, "gate")].num_tokens == tokens


def test_every_expert_is_written_packed_under_its_checkpoint_name(
    tmp_path: Path, tiny_moe: Path
) -> None:
    out = tmp_path / "w4a16"
    llmq.quantize(tiny_moe, out, scheme="w4a16", num_samples=4, seq_len=32, reference=False)
    written: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        written.update(load_file(shard))
    source = load_file(tiny_moe / "model.safetensors")
    for layer in expert_layers(tiny_moe):
        linears = [expert(tiny_moe, e, role) for e in range(EXPERTS) for role in ROLES]
        if names(tiny_moe).shared:
            linears += [f"{names(tiny_moe).shared}.{r}_proj" for r in ROLES]
        for name in (f"model.layers.{layer}.{linear}" for linear in linears):
            assert f"{name}.weight_packed" in written and f"{name}.weight" not in written
        for kept in routers(tiny_moe):  # as they were
            name = f"model.layers.{layer}.{kept}.weight"
            assert torch.equal(written[name], source[name])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    targets = [t for group in config["config_groups"].values() for t in group["targets"]]
    experts = sorted(t for t in targets if ".experts" in t)  # one target per role, any expert
    module = re.escape(names(tiny_moe).module)
    assert experts == sorted(rf"re:.*{module}\.\d+\.{getattr(names(tiny_moe), r)}$" for r in ROLES)  # fmt: skip
    assert not any(re.match(t[3:], f"model.layers.0.{router}") for t in targets for router in routers(tiny_moe))  # fmt: skip
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(theirs), logits(llmq.load_dequantized(out)), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_gptq_on_the_experts_beats_rtn_in_every_layer(tmp_path: Path, tiny_moe: Path) -> None:
    result = llmq.quantize(tiny_moe, tmp_path / "gptq", scheme="w4a16", method="gptq",
                           num_samples=4, seq_len=32, reference=False)  # fmt: skip
    calibration = json.loads((tmp_path / "gptq" / "llmq.json").read_text())["calibration"]
    assert calibration["moe_calibration"] == "all"
    for layer in result.layers:
        assert layer.output_rel_rmse < layer.rtn_output_rel_rmse
        experts = 3 * EXPERTS if layer.index in expert_layers(tiny_moe) else 0
        assert sum(".experts." in linear.name for linear in layer.linears) == experts


def test_dense_layers_between_expert_layers_take_their_own_layout(
    tmp_path: Path, default_model: Path
) -> None:
    """Qwen3-MoE's `mlp_only_layers` (and DeepSeek-V3's first layers) have a plain MLP: each
    layer is quantized with its own linears and reloads in transformers."""
    model = make_tiny(tmp_path / "mixed", default_model, model_type="qwen3_moe", layers=3,
                      mlp_only_layers=[1])  # fmt: skip
    assert expert_layers(model) == [0, 2]
    out = tmp_path / "gptq"
    result = llmq.quantize(model, out, scheme="w4a16", method="gptq", num_samples=4, seq_len=32,
                           reference=False)  # fmt: skip
    written = {name for shard in out.glob("*.safetensors") for name in load_file(shard)}
    assert "model.layers.1.mlp.down_proj.weight_packed" in written
    assert "model.layers.2.mlp.experts.3.down_proj.weight_packed" in written
    assert [len(layer.linears) for layer in result.layers] == [4 + 3 * EXPERTS, 7, 4 + 3 * EXPERTS]
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(theirs), logits(llmq.load_dequantized(out)), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_a_scale_folded_into_the_mlp_norm_is_undone_in_the_router(
    tmp_path: Path, tiny_moe: Path
) -> None:
    """The router reads the same norm as the experts: SmoothQuant's 1/s in the norm comes back
    as s in the router's columns (router x norm unchanged), so every token keeps its experts."""
    out = tmp_path / "w8a8"
    result = llmq.quantize(tiny_moe, out, scheme="w8a8", smooth=0.8, num_samples=4, seq_len=32,
                           reference=False)  # fmt: skip
    written: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        written.update(load_file(shard))
    source = load_file(tiny_moe / "model.safetensors")
    for layer in expert_layers(tiny_moe):
        norm = f"model.layers.{layer}.post_attention_layernorm.weight"
        assert not torch.allclose(written[norm], source[norm])  # a scale was folded
        for router in (f"model.layers.{layer}.{gate}.weight" for gate in routers(tiny_moe)):
            torch.testing.assert_close(
                written[router] * written[norm], source[router] * source[norm]
            )
    assert all(layer.output_rel_rmse < 0.1 for layer in result.layers)


def test_latent_attention_refuses_kv_cache_scales_before_any_work(
    tmp_path: Path, default_model: Path
) -> None:
    """DeepSeek's cache holds the compressed latent, not the keys and values the scales are for."""
    model = make_tiny(tmp_path / "deepseek", default_model, model_type="deepseek_v3")
    with pytest.raises(InputError, match="compressed latent"):
        llmq.quantize(model, tmp_path / "out", scheme="fp8", kv_cache="fp8", num_samples=4, seq_len=32)  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_deepseek_without_low_rank_queries_is_refused_in_one_line(
    tmp_path: Path, default_model: Path
) -> None:
    model = make_tiny(tmp_path / "lite", default_model, model_type="deepseek_v3", q_lora_rank=None)
    with pytest.raises(UnsupportedModelError, match="without q_lora_rank"):
        open_checkpoint(model)
