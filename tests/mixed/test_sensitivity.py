"""The damages the solver minimizes, against references: the output measure equals the squared
output error computed in float64 from the activations themselves; the Fisher measure weighs the
squared rounding error by each weight's squared loss gradient (computed here with backward());
dense costs no damage; a mixture's experts form one unit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llmq.calib.stats import InputStats
from llmq.config import MixedConfig, QuantArgs, fit_group_size
from llmq.io.checkpoint import open_checkpoint
from llmq.mixed.choose import linear_of, plan_budget
from llmq.mixed.sensitivity import _output_measure, candidate_damages, measure_damages
from llmq.mixed.units import Linear, scheme_candidates
from llmq.quant.rtn import rtn_quantize_weight
from tests.conftest import make_tiny

CANDIDATES = scheme_candidates(("int4-g128", "int4-g32", "int8", "dense"))


def test_output_damage_is_the_float64_output_error_on_the_activations() -> None:
    torch.manual_seed(0)
    x = torch.randn(300, 192) * torch.linspace(0.1, 4, 192)
    weight = torch.randn(64, 192) * 0.05
    stats = InputStats.empty(192, hessian=True, device=x.device)
    for chunk in x.split(100):
        stats.update(chunk)
    linear = Linear("w", 64, 192, torch.float32)
    damages = candidate_damages(weight, linear, CANDIDATES, _output_measure(stats.hessian))
    for candidate, damage in zip(CANDIDATES, damages, strict=True):
        if candidate.args is None:
            assert damage == 0.0
            continue
        args = fit_group_size(candidate.args, 192)  # g128 -> g64 on 192 inputs
        delta = rtn_quantize_weight(weight, args).dequantize(torch.float64) - weight.double()
        reference = 2 / len(x) * (x.double() @ delta.T).square().sum()
        assert damage == pytest.approx(float(reference), rel=1e-4)
    assert damages[0] > damages[1] > damages[2] > damages[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return make_tiny(tmp_path_factory.mktemp("sens") / "llama", default_model)


def test_fisher_damage_weighs_rounding_by_the_squared_gradients(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = open_checkpoint(tiny)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    linears = [linear_of(ckpt, name) for name in names]
    ids = torch.randint(0, 49152, (3, 32), generator=torch.Generator().manual_seed(1))
    config = MixedConfig(target_bits=5, sensitivity="fisher", fisher_windows=3)
    damages = measure_damages(ckpt, linears, CANDIDATES, config, ids)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    fisher = {name: torch.zeros_like(model.get_submodule(name).weight) for name in names}
    for window in ids:
        model.zero_grad()
        model(input_ids=window[None], labels=window[None]).loss.backward()
        for name in names:
            fisher[name] += model.get_submodule(name).weight.grad.square() / len(ids)
    for linear in linears:
        weight = model.get_submodule(linear.name).weight.detach()
        for candidate, damage in zip(CANDIDATES, damages[linear.name], strict=True):
            args = candidate.fitted(linear)
            if args is None:
                assert damage == 0.0
                continue
            delta = rtn_quantize_weight(weight, args).dequantize(torch.float32) - weight
            assert damage == pytest.approx(float((fisher[linear.name] * delta.square()).sum()), rel=1e-3)  # fmt: skip


def test_weight_damage_is_the_squared_rounding_error(tiny: Path) -> None:
    ckpt = open_checkpoint(tiny)
    linear = linear_of(ckpt, "model.layers.1.self_attn.o_proj")
    config = MixedConfig(target_bits=5, sensitivity="weight")
    damages = measure_damages(ckpt, [linear], CANDIDATES, config, None)[linear.name]
    weight = ckpt.read(f"{linear.name}.weight").float()
    args: QuantArgs = CANDIDATES[1].fitted(linear)  # type: ignore[assignment]
    delta = rtn_quantize_weight(weight, args).dequantize(torch.float32) - weight
    assert damages[1] == pytest.approx(float(delta.square().sum()), rel=1e-5)


def test_a_mixtures_experts_share_one_unit(tmp_path: Path, default_model: Path) -> None:
    """Every expert linear of a layer (vLLM runs them as one fused kernel) in one unit; the
    attention's q/k/v in another."""
    ckpt = open_checkpoint(make_tiny(tmp_path / "moe", default_model, model_type="qwen3_moe"))
    layers = [[linear_of(ckpt, n) for n in ckpt.layout.linear_names(i)] for i in range(ckpt.num_layers)]  # fmt: skip
    budget = plan_budget(ckpt, layers, MixedConfig(target_bits=6))
    names = [[linear.name.split(".", 3)[3] for linear in unit] for unit in budget.units[:4]]
    assert names[0] == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    experts = next(unit for unit in names if unit[0].startswith("mlp.experts."))
    assert len(experts) == 3 * 4  # gate, up and down of 4 experts


def test_residual_damage_is_output_damage_over_the_streams_mean_square(tiny: Path) -> None:
    """Layer 0 reads the embeddings: its linears' residual damages are their output damages
    over the mean square of the embedded windows; every linear of a layer shares the divisor."""
    ckpt = open_checkpoint(tiny)
    names = [n for i in range(ckpt.num_layers) for n in ckpt.layout.linear_names(i)]
    linears = [linear_of(ckpt, name) for name in names]
    ids = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(2))
    damages = {
        kind: measure_damages(
            ckpt, linears, CANDIDATES, MixedConfig(target_bits=5, sensitivity=kind), ids
        )
        for kind in ("output", "residual")
    }
    embedded = ckpt.read("model.embed_tokens.weight").double()[ids]
    energy = float(embedded.square().mean())
    for name in names:
        ratios = [o / r for o, r in zip(damages["output"][name], damages["residual"][name], strict=True) if r]  # fmt: skip
        assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)
        if name.startswith("model.layers.0."):
            assert ratios[0] == pytest.approx(energy, rel=1e-5)


def whole_model_gradient_damages(folder: Path, linear: Linear, ids: torch.Tensor) -> list[float]:
    """Σ_j G_j (ΔW H ΔWᵀ)_jj with G the per-token squared gradient of the summed loss at the
    linear's output and H its inputs' covariance, both from one retained forward and backward
    pass of transformers' whole model per window, in float64 (0 for dense)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    module = model.get_submodule(linear.name)
    seen: dict[str, torch.Tensor] = {}
    module.register_forward_hook(lambda _m, a, o: seen.update(x=a[0], y=o) or o.retain_grad())
    g2 = torch.zeros(linear.rows, dtype=torch.float64)
    h = torch.zeros(linear.columns, linear.columns, dtype=torch.float64)
    for window in ids:
        loss = model(input_ids=window[None], labels=window[None]).loss * (len(window) - 1)
        loss.backward()
        g2 += seen["y"].grad.double().reshape(-1, linear.rows).square().sum(0) / ids.numel()
        x = seen["x"].detach().double().reshape(-1, linear.columns)
        h += x.T @ x / ids.numel()
    weight = module.weight.detach()
    damages = []
    for candidate in CANDIDATES:
        args = candidate.fitted(linear)
        if args is None:
            damages.append(0.0)
            continue
        delta = rtn_quantize_weight(weight, args).dequantize(torch.float64) - weight.double()
        damages.append(float((g2[:, None] * (delta @ h) * delta).sum()))
    return damages


def test_gradient_damage_weighs_each_output_channels_error_by_its_squared_loss_gradient(
    tiny: Path,
) -> None:
    """The layer-by-layer gradient damages equal the whole model's (above)."""
    ckpt = open_checkpoint(tiny)
    linear = linear_of(ckpt, "model.layers.1.mlp.down_proj")
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(3))
    config = MixedConfig(target_bits=5, sensitivity="gradient", fisher_windows=2)
    damages = measure_damages(ckpt, [linear], CANDIDATES, config, ids)[linear.name]
    assert damages == pytest.approx(whole_model_gradient_damages(tiny, linear, ids), rel=1e-4)


def test_gradient_damage_through_a_mixture_of_experts(tmp_path: Path, default_model: Path) -> None:
    """The loss goes backward through a mixture's routed experts one layer at a time: layer 0's
    attention sees the gradient that flowed through layer 1's experts, as in transformers'
    whole model; each expert's damages are finite and ordered."""
    tiny_moe = make_tiny(tmp_path / "moe", default_model, model_type="qwen3_moe")
    ckpt = open_checkpoint(tiny_moe)
    names = ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.experts.2.down_proj"]
    linears = [linear_of(ckpt, name) for name in names]
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(4))
    config = MixedConfig(target_bits=5, sensitivity="gradient", fisher_windows=2)
    damages = measure_damages(ckpt, linears, CANDIDATES, config, ids)
    reference = whole_model_gradient_damages(tiny_moe, linears[0], ids)
    assert damages[names[0]] == pytest.approx(reference, rel=1e-4)
    expert = damages[names[1]]
    assert all(math.isfinite(d) for d in expert) and expert[0] > expert[1] > expert[2] > expert[3] == 0.0  # fmt: skip
