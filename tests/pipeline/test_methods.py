"""GPTQ and AWQ through the layer pipeline: reload equivalence, reports, bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import llmq
from llmq.errors import InputError
from llmq.io import family
from tests.pipeline.test_quantize import checkpoint_bytes, logits_pair

CALIB = {"num_samples": 4, "seq_len": 64, "calib_text": "pydoc"}


@pytest.mark.parametrize(
    ("method", "scheme", "options"),
    [
        ("gptq", "w4a16", {"actorder": "static"}),
        ("gptq", "w4a16-asym", {"actorder": "none", "group_size": -1}),
        ("awq", "w4a16-asym", {"clip": "output"}),
        ("awq+gptq", "w4a16", {}),
    ],
)
def test_method_reloads_with_the_logits_llmq_evaluated(
    tmp_path: Path, tiny_llama: Path, method: str, scheme: str, options: dict
) -> None:
    """transformers (compressed-tensors) and llmq's dequantized model agree, AWQ's folded norms
    included; asymmetric zero points are compared through llmq's reader (see test_quantize)."""
    out = tmp_path / method
    result = llmq.quantize(tiny_llama, out, scheme=scheme, method=method, **CALIB, **options)
    if scheme == "w4a16":
        theirs, ours = logits_pair(out)
        assert float((theirs - ours).abs().max()) <= 1e-5 * float(ours.abs().max())
    layers = result.layers
    assert all(layer.rtn_output_rel_rmse is not None for layer in layers)
    linears = [linear for layer in layers for linear in layer.linears]
    assert all(
        linear.output_error is not None and linear.rtn_output_error is not None
        for linear in linears
    )
    if method == "awq":
        assert [s.producer for s in layers[0].scales] == [
            "input_layernorm",
            "post_attention_layernorm",
            "mlp.up_proj",
        ]


@pytest.mark.integration
def test_gptq_beats_rtn_on_the_calibration_outputs(tmp_path: Path, default_model: Path) -> None:
    result = llmq.quantize(
        default_model, tmp_path / "g", scheme="w4a16", group_size=64, method="gptq",
        num_samples=2, seq_len=256, calib_text="pydoc", ignore=[r"re:model\.layers\.([2-9]|\d\d)\."],
    )  # fmt: skip
    layer = result.layers[0]
    assert layer.output_rel_rmse < 0.9 * layer.rtn_output_rel_rmse
    for linear in layer.linears:
        assert linear.output_error < linear.rtn_output_error, linear.name
        assert linear.loss is not None and linear.dampening_frac == 0.01


def test_awq_refused_without_pairings(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = dataclasses.replace(family.FAMILY_LAYOUT["llama"], smooth=())
    monkeypatch.setitem(family.FAMILY_LAYOUT, "llama", bare)
    with pytest.raises(InputError, match="no norm/linear pairings"):
        llmq.quantize(tiny_llama, tmp_path / "a", method="awq", **CALIB)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("scheme", ["w4a16-asym", "w8a8"])
def test_linears_sharing_an_input_are_quantized_as_one_stack(
    tmp_path: Path, tiny_llama: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v and gate/up go through GPTQ as two stacked weights, and the checkpoint and the
    per-linear losses are those of quantizing every linear alone."""
    from llmq.pipeline import linears
    from llmq.quant.methods import GPTQ

    calls: list[int] = []
    solve = GPTQ.quantize_weight

    def counted(self, weight, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(weight.shape[0])
        return solve(self, weight, *args, **kwargs)

    monkeypatch.setattr(GPTQ, "quantize_weight", counted)
    stacked = llmq.quantize(tiny_llama, tmp_path / "stacked", scheme=scheme, method="gptq", **CALIB)
    per_layer = len(calls) // len(stacked.layers)
    assert per_layer == 4  # q/k/v, o, gate/up, down
    monkeypatch.setattr(
        linears, "_stacks", lambda local, _stats, _fused: [[name] for name in local]
    )
    alone = llmq.quantize(tiny_llama, tmp_path / "alone", scheme=scheme, method="gptq", **CALIB)
    assert len(calls) == per_layer * len(stacked.layers) + 7 * len(alone.layers)
    assert checkpoint_bytes(tmp_path / "stacked") == checkpoint_bytes(tmp_path / "alone")
    for ours, theirs in zip(stacked.layers, alone.layers, strict=True):
        for a, b in zip(ours.linears, theirs.linears, strict=True):
            assert (a.name, a.weight_nrmse) == (b.name, b.weight_nrmse)
            assert a.loss == pytest.approx(b.loss, rel=1e-5)


def test_raised_dampening_is_reported(
    tmp_path: Path, tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One calibration token makes every Hessian rank one: the dampening carries it."""
    result = llmq.quantize(
        tiny_llama, tmp_path / "d", method="gptq", num_samples=1, seq_len=8, dampening_frac=1e-9
    )
    fracs = [linear.dampening_frac for layer in result.layers for linear in layer.linears]
    assert max(fracs) > 1e-9
    assert "not positive definite" in caplog.text
    assert all(torch.isfinite(torch.tensor(fracs)))
