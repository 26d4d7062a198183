"""LayerStream.run_layer: what it returns when callers keep only part of the outputs, or none of
the inputs; activation quantization of inputs that linears share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmq.calib.collect import run_observed
from llmq.calib.hooks import activation_quantization, input_hooks
from llmq.calib.stream import LayerStream
from llmq.config import QuantArgs
from llmq.io.checkpoint import open_checkpoint
from llmq.quant.primitives import fake_quantize
from tests.conftest import make_tiny


@pytest.fixture(scope="module")
def stream_and_layer(tiny_llama: Path) -> tuple[LayerStream, torch.nn.Module]:
    stream = LayerStream(open_checkpoint(tiny_llama), device="cpu", batch_size=2)
    return stream, stream.load_layer(0)


def _hidden(stream: LayerStream, samples: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4)
    return torch.randn(samples, 24, stream.config.hidden_size, generator=generator)


def test_keep_returns_the_leading_outputs_of_a_full_run(stream_and_layer) -> None:
    stream, layer = stream_and_layer
    hidden = _hidden(stream)
    full = stream.run_layer(layer, hidden)
    window = layer(hidden[3:4], attention_mask=None, position_embeddings=stream._rotary(
        hidden[:1], torch.arange(24).unsqueeze(0)))  # fmt: skip
    window = window[0] if isinstance(window, tuple) else window
    torch.testing.assert_close(full[3:4], window)  # micro-batching changes nothing
    for keep in (0, 3, 9):  # inside a micro-batch, none, more than there are
        kept = stream.run_layer(layer, hidden, keep=keep)
        assert kept.shape[0] == min(keep, 5)
        assert torch.equal(kept, full[:keep])


def test_in_place_overwrites_the_inputs_with_the_outputs(stream_and_layer) -> None:
    stream, layer = stream_and_layer
    hidden = _hidden(stream)
    expected = stream.run_layer(layer, hidden)
    out = stream.run_layer(layer, hidden, in_place=True)
    assert out.data_ptr() == hidden.data_ptr()
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="exclude"):
        stream.run_layer(layer, hidden, keep=1, in_place=True)


def test_statistics_see_every_sample_whatever_is_kept(stream_and_layer) -> None:
    stream, layer = stream_and_layer
    hidden = _hidden(stream)
    names = ["self_attn.q_proj", "mlp.down_proj"]
    down_proj_runs = []
    handle = layer.get_submodule("mlp.down_proj").register_forward_hook(
        lambda _module, args, _out: down_proj_runs.append(args[0].shape[0])
    )
    try:
        _, everything = run_observed(stream, layer, names, hidden, hessian=True)
        assert down_proj_runs == [2, 2, 1]
        down_proj_runs.clear()
        kept, partial = run_observed(stream, layer, names, hidden, hessian=True, keep=1)
    finally:
        handle.remove()
    assert kept.shape[0] == 1
    # the micro-batches after the kept one stop before down_proj's product, after its input is seen
    assert down_proj_runs == [2]
    for name in names:
        assert partial[name].num_tokens == everything[name].num_tokens == 5 * 24
        assert torch.equal(partial[name].hessian, everything[name].hessian)
        assert torch.equal(partial[name].absmax, everything[name].absmax)


def _int8(dynamic: bool) -> QuantArgs:
    return QuantArgs(num_bits=8, type="int", symmetric=True, strategy="token" if dynamic else "tensor",
                     dynamic=dynamic)  # fmt: skip


def test_shared_inputs_are_quantized_once_with_the_same_result(stream_and_layer, monkeypatch):
    stream, layer = stream_and_layer
    hidden = _hidden(stream)
    names = [name for group in stream.layout.sequential for name in group]
    dynamic = {name: (_int8(True), None) for name in names}
    # k_proj has its own static scale: it must not reuse q_proj's (dynamic) result
    mixed = {**dynamic, "self_attn.k_proj": (_int8(False), torch.tensor([0.05]))}
    for inputs in (dynamic, mixed):
        with input_hooks(layer, names, lambda name, x, i=inputs: fake_quantize(x, *i[name])):
            expected = stream.run_layer(layer, hidden)
        calls: list[torch.Tensor] = []

        def counted(x, *spec, calls=calls):
            calls.append(x)
            return fake_quantize(x, *spec)

        monkeypatch.setattr("llmq.calib.hooks.fake_quantize", counted)
        with activation_quantization(layer, inputs):
            got = stream.run_layer(layer, hidden)
        monkeypatch.undo()
        assert torch.equal(got, expected)
        distinct = 4 if inputs is dynamic else 5  # q/v, o, gate/up, down (+ k with its own)
        assert len(calls) == distinct * len(list(stream.batches(hidden)))


def _resident_bytes_of(path: Path) -> int:
    """Bytes of `path`'s memory maps that are resident in this process (from /proc/self/smaps)."""
    resident, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1]) * 1024
    return resident


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_layers_already_dropped_leave_no_mapped_pages(tmp_path: Path, default_model: Path) -> None:
    model = make_tiny(tmp_path / "model", default_model, layers=6)
    shard = (model / "model.safetensors").resolve()
    stream = LayerStream(open_checkpoint(model), device="cpu")
    layer_bytes = sum(p.numel() * p.element_size() for p in stream.load_layer(0).parameters())
    for index in range(6):
        layer = stream.load_layer(index)
        assert sum(float(p.detach().sum()) for p in layer.parameters()) != 0  # every page read
        # the live layer's pages only, not those of the layers before it
        assert _resident_bytes_of(shard) <= layer_bytes + 64 * 1024
        del layer
    assert _resident_bytes_of(shard) == 0


def test_replaced_blocks_answer_from_their_outputs_and_run_until_stops(stream_and_layer) -> None:
    stream, layer = stream_and_layer
    hidden = _hidden(stream)
    attention = layer.get_submodule(stream.layout.attention)
    outputs: list[torch.Tensor] = []
    handle = attention.register_forward_hook(lambda _m, _a, out: outputs.append(out[0]))
    full = stream.run_layer(layer, hidden)
    handle.remove()
    kept = torch.cat(outputs)
    calls = {"q_proj": 0, "down_proj": 0, "gate_proj": 0}
    hooks = [
        layer.get_submodule(name).register_forward_hook(  # counts the runs that finish
            lambda _m, _a, _out, key=key: calls.__setitem__(key, calls[key] + 1)
        )
        for key, name in (
            ("q_proj", "self_attn.q_proj"),
            ("gate_proj", "mlp.gate_proj"),
            ("down_proj", "mlp.down_proj"),
        )
    ]
    norms = {"input_layernorm": [], "post_attention_layernorm": []}  # output is input?
    hooks += [
        layer.get_submodule(name).register_forward_hook(
            lambda _m, args, out, seen=seen: seen.append(out is args[0])
        )
        for name, seen in norms.items()
    ]
    replace = {stream.layout.attention: lambda rows: kept[rows]}
    torch.testing.assert_close(stream.run_layer(layer, hidden, replace=replace), full)
    assert calls == {"q_proj": 0, "gate_proj": 3, "down_proj": 3}  # 5 samples, batches of 2
    # nothing reads the output of the norm in front of the replaced attention: it passes through
    assert norms == {"input_layernorm": [True] * 3, "post_attention_layernorm": [False] * 3}
    stream.run_until(layer, hidden, "mlp.down_proj", replace=replace)
    assert calls == {"q_proj": 0, "gate_proj": 6, "down_proj": 3}
    for hook in hooks:
        hook.remove()
    norm = layer.get_submodule("input_layernorm")
    assert not torch.equal(norm(hidden[0]), hidden[0])  # normalizes again once the call is over
    assert "forward" not in vars(attention) and "forward" not in vars(norm)
