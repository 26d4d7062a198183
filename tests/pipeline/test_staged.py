"""The in-layer sequential schedule of GPTQ-style methods: each group of linears is observed
after the groups before it are quantized, and what the layer writes is the quantized layer's
output, as if it had run whole."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import Tensor

from llmq.api import make_recipe
from llmq.calib.collect import run_observed
from llmq.calib.stream import LayerStream
from llmq.calib.windows import model_windows
from llmq.config import Recipe
from llmq.io.checkpoint import open_checkpoint
from llmq.pipeline.linears import REPORT_WINDOWS
from llmq.pipeline.plan import plan_quantization
from llmq.pipeline.staged import StagedLayer, stages_in_layer
from llmq.progress import NO_PROGRESS
from llmq.quant.methods import Method, MethodResult, get_method


@dataclass
class Recording:
    """A method that keeps the Hessian each call was given, then quantizes as `inner`."""

    inner: Method
    hessians: list[Tensor] = field(default_factory=list)
    name: str = "gptq"
    needs_hessian: bool = True
    needs_norms: bool = False
    awq: None = None
    sparsity: None = None

    def quantize_weight(self, weight, args, stats, *, scale_dtype) -> MethodResult:
        self.hessians.append(stats.hessian.clone())
        return self.inner.quantize_weight(weight, args, stats, scale_dtype=scale_dtype)


@pytest.fixture(
    scope="module", params=[(), ("self_attn.q_proj", "mlp.down_proj")], ids=["all", "some-ignored"]
)
def staged_run(tiny_llama: Path, request: pytest.FixtureRequest):
    """Layer 0 of the tiny model quantized W4A16 GPTQ by `StagedLayer` on embedded tokens;
    with linears left in full precision too (a group's first linear, a block's output projection),
    as `--ignore` and `--fallback` leave them."""
    ckpt = open_checkpoint(tiny_llama)
    recipe = make_recipe(scheme="w4a16", method="gptq", group_size=32)
    stream = LayerStream(ckpt, device="cpu", batch_size=2)
    prefix = stream.layout.layer_prefix(0)
    local = {
        linear.name[len(prefix) :]: linear for linear in plan_quantization(ckpt, recipe).layers[0]
    }
    for name in request.param:
        del local[name]
    ids = torch.randint(
        0, stream.config.vocab_size, (5, 32), generator=torch.Generator().manual_seed(0)
    )
    inputs = stream.embed(ids)
    hidden = inputs.clone()
    layer = stream.load_layer(0)
    method = Recording(get_method(recipe))
    assert stages_in_layer(stream, recipe, method, None, local)
    done = StagedLayer(stream, layer, local, method, recipe, hidden, lambda: None).run()
    return stream, layer, inputs, done, method, local


def test_each_group_is_observed_after_the_groups_before_it_are_quantized(staged_run) -> None:
    """The Hessian each group got is the one a whole-layer pass observes with the groups before
    it quantized and the rest still in full precision."""
    stream, quantized, inputs, _, method, local = staged_run
    groups = [[name for name in group if name in local] for group in stream.layout.sequential]
    groups = [group for group in groups if group]
    assert len(method.hessians) == len(groups)  # q/k/v and gate/up are one stack each
    for position, group in enumerate(groups):
        layer = stream.load_layer(0)
        for earlier in groups[:position]:
            for name in earlier:
                layer.get_submodule(name).weight.data = quantized.get_submodule(name).weight.data
        _, observed = run_observed(stream, layer, group, inputs.clone(), hessian=True)
        expected = observed[group[0]].hessian
        torch.testing.assert_close(method.hessians[position], expected, rtol=1e-4, atol=1e-6)
        if position > 0:  # the float layer's Hessian differs: quantization upstream shows
            _, floats = run_observed(
                stream, stream.load_layer(0), group, inputs.clone(), hessian=True
            )
            assert not torch.allclose(floats[group[0]].hessian, expected, rtol=1e-4, atol=1e-6)


def test_the_output_is_the_quantized_layer_run_whole(staged_run) -> None:
    stream, quantized, inputs, done, _, local = staged_run
    expected = stream.run_layer(quantized, inputs)
    torch.testing.assert_close(done.output, expected, rtol=1e-5, atol=1e-5)
    windows = slice(REPORT_WINDOWS)  # the error is measured on the first windows only
    float_output = stream.run_layer(stream.load_layer(0), inputs[windows])
    relative = float((expected[windows] - float_output).norm() / float_output.norm())
    assert done.error == pytest.approx(relative, rel=1e-4)
    assert done.error < done.rtn_error  # GPTQ beats plain RTN on the windows it saw
    assert [report.name for report in done.linears] == [
        stream.layout.layer_prefix(0) + name for name in stream.layout.linears if name in local
    ]


def test_layers_sharing_buffers_give_what_fresh_buffers_give(tiny_llama: Path) -> None:
    """The pipeline hands every layer the same ReusedBuffers (captured inputs and kept outputs
    reuse one layer's memory in the next): two layers in a row give bit-identical outputs and
    tensors to two layers each with buffers of its own."""
    from llmq.heap import ReusedBuffers

    ckpt = open_checkpoint(tiny_llama)
    recipe = make_recipe(scheme="w4a16", method="gptq", group_size=32)
    stream = LayerStream(ckpt, device="cpu", batch_size=2)
    plan = plan_quantization(ckpt, recipe)
    ids = torch.randint(
        0, stream.config.vocab_size, (5, 32), generator=torch.Generator().manual_seed(0)
    )

    def two_layers(shared: ReusedBuffers | None) -> list:
        hidden, results = stream.embed(ids), []
        for index in (0, 1):
            prefix = stream.layout.layer_prefix(index)
            local = {lin.name[len(prefix) :]: lin for lin in plan.layers[index]}
            done = StagedLayer(
                stream, stream.load_layer(index), local, get_method(recipe), recipe, hidden,
                lambda: None, shared,
            ).run()  # fmt: skip
            results.append((done.output.clone(), done.tensors))
        return results

    for (output, tensors), (fresh_output, fresh_tensors) in zip(
        two_layers(ReusedBuffers()), two_layers(None), strict=True
    ):
        assert torch.equal(output, fresh_output)
        assert tensors.keys() == fresh_tensors.keys()
        assert all(torch.equal(tensors[key], fresh_tensors[key]) for key in tensors)


def test_rtn_with_output_clipping_runs_staged_without_comparing_with_itself(
    tiny_llama: Path,
) -> None:
    """RTN's output-error clip search needs Hessians, so it takes the staged schedule too; it has
    no RTN comparison (it is RTN)."""
    ckpt = open_checkpoint(tiny_llama)
    recipe = make_recipe(scheme="w4a16", method="rtn", clip="output", group_size=32)
    method = get_method(recipe)
    stream = LayerStream(ckpt, device="cpu", batch_size=2)
    prefix = stream.layout.layer_prefix(0)
    local = {
        linear.name[len(prefix) :]: linear for linear in plan_quantization(ckpt, recipe).layers[0]
    }
    assert stages_in_layer(stream, recipe, method, None, local)
    inputs = torch.randn(
        3, 16, stream.config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    layer = stream.load_layer(0)
    done = StagedLayer(stream, layer, local, method, recipe, inputs.clone(), lambda: None).run()
    assert done.rtn_error is None
    assert all(report.rtn_output_error is None for report in done.linears)
    torch.testing.assert_close(done.output, stream.run_layer(layer, inputs), rtol=1e-5, atol=1e-5)


def test_no_true_sequential_observes_the_float_layer_whole(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--no-true-sequential`: every group of every layer gets the Hessian of the full-precision
    layer on that layer's inputs (one observation pass), and the recipe records the choice."""
    from typer.testing import CliRunner

    from llmq.cli.main import app
    from llmq.quant import methods

    seen: list[Tensor] = []
    gptq = methods.GPTQ.quantize_weight

    def recording(self, weight, args, stats, *, scale_dtype):
        seen.append(stats.hessian.clone())
        return gptq(self, weight, args, stats, scale_dtype=scale_dtype)

    monkeypatch.setattr(methods.GPTQ, "quantize_weight", recording)
    out = tmp_path / "two-pass"
    options = ["--method", "gptq", "--group-size", "32", "--num-samples", "3", "--seq-len", "24"]
    result = CliRunner().invoke(
        app, ["quantize", str(tiny_llama), "--out", str(out), *options, "--no-true-sequential"]
    )
    assert result.exit_code == 0, result.output
    record = json.loads((out / "llmq.json").read_text())
    assert record["recipe"]["gptq"]["true_sequential"] is False
    ckpt = open_checkpoint(tiny_llama)
    groups = ckpt.layout.sequential
    assert len(seen) == len(groups) * ckpt.num_layers
    recipe = Recipe.model_validate(record["recipe"])
    stream = LayerStream(ckpt, device="cpu")
    windows = model_windows(tiny_llama, recipe.calibration, NO_PROGRESS)
    _, observed = run_observed(
        stream, stream.load_layer(0), list(ckpt.layout.linears), stream.embed(windows.input_ids),
        hessian=True,
    )  # fmt: skip
    for position, group in enumerate(groups):  # layer 0's groups, all from the float layer
        torch.testing.assert_close(seen[position], observed[group[0]].hessian)


def test_recomputed_stages_give_the_kept_stages_bits_and_hold_nothing(tiny_llama: Path) -> None:
    """`keep=False` (--stage-activations recompute) reruns the blocks before each stage instead
    of keeping their outputs: the same output and tensors, bit for bit, with no activations
    held beyond the layer's input; `keep=True` holds exactly what `kept_activation_bytes`
    (the auto setting's estimate) says."""
    from llmq.heap import ReusedBuffers
    from llmq.pipeline.staged import keeps_activations, kept_activation_bytes

    ckpt = open_checkpoint(tiny_llama)
    recipe = make_recipe(scheme="w4a16", method="gptq", group_size=32)
    stream = LayerStream(ckpt, device="cpu", batch_size=2)
    prefix = stream.layout.layer_prefix(0)
    local = {lin.name[len(prefix) :]: lin for lin in plan_quantization(ckpt, recipe).layers[0]}
    ids = torch.randint(
        0, stream.config.vocab_size, (5, 32), generator=torch.Generator().manual_seed(0)
    )
    runs = {}
    for keep in (True, False):
        buffers, hidden, layer = ReusedBuffers(), stream.embed(ids), stream.load_layer(0)
        done = StagedLayer(
            stream, layer, local, get_method(recipe), recipe, hidden, lambda: None, buffers,
            keep=keep,
        ).run()  # fmt: skip
        runs[keep] = (done, buffers.held_bytes())
    (kept, kept_bytes), (recomputed, recomputed_bytes) = runs[True], runs[False]
    assert torch.equal(recomputed.output, kept.output)
    assert recomputed.tensors.keys() == kept.tensors.keys()
    assert all(torch.equal(recomputed.tensors[k], kept.tensors[k]) for k in kept.tensors)
    assert recomputed_bytes == 0
    assert kept_bytes == kept_activation_bytes(stream, layer, stream.embed(ids)) > 0
    assert keeps_activations("auto", stream, layer, hidden, ReusedBuffers())  # the CPU keeps
    assert not keeps_activations("recompute", stream, layer, hidden, ReusedBuffers())
