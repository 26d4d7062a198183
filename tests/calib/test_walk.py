"""LayerStream.walk: the one loop over decoder layers. Each layer's input is what the one before
handed back, a resumed walk starts where asked, and a layer is dropped before the next loads."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from llmq.calib.stream import LayerStream
from llmq.io.checkpoint import open_checkpoint
from tests.calib.test_stream import _resident_bytes_of
from tests.conftest import make_tiny


class Recorded:
    """A progress sink that records (stage, total) and every advance."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    @contextmanager
    def stage(self, description: str, total: int | None = None, *, transient: bool = False):
        self.events.append(("stage", (description, total)))
        yield lambda steps=1, status=None: self.events.append(("advance", steps))


def test_the_walk_runs_the_layers_in_order_as_a_hand_written_loop(tiny_llama: Path) -> None:
    stream = LayerStream(open_checkpoint(tiny_llama), device="cpu")
    ids = torch.randint(0, 49152, (3, 16), generator=torch.Generator().manual_seed(0))
    by_hand = stream.embed(ids)
    for index in range(stream.num_layers):
        by_hand = stream.run_layer(stream.load_layer(index), by_hand)
    progress = Recorded()
    walk = stream.walk(stream.embed(ids), progress=progress, label="walking")
    seen = []
    for layer in walk:
        seen.append((layer.index, layer.prefix))
        layer.advance(stream.run_layer(layer.module, layer.hidden, in_place=True))
    assert seen == [(0, "model.layers.0."), (1, "model.layers.1.")]
    assert torch.equal(walk.hidden, by_hand)
    assert progress.events == [("stage", ("walking", 2)), ("advance", 1), ("advance", 1)]


def test_a_resumed_walk_counts_the_layers_before_it_as_done(tiny_llama: Path) -> None:
    stream = LayerStream(open_checkpoint(tiny_llama), device="cpu")
    progress = Recorded()
    walk = stream.walk(None, start=1, progress=progress)
    assert len(walk) == 1
    for layer in walk:
        assert (layer.index, layer.hidden) == (1, None)
        layer.advance(None)
    assert walk.hidden is None
    assert progress.events == [("stage", ("layers", 2)), ("advance", 1), ("advance", 1)]


def test_an_output_not_handed_back_stops_the_walk(tiny_llama: Path) -> None:
    stream = LayerStream(open_checkpoint(tiny_llama), device="cpu")
    with pytest.raises(RuntimeError, match="layer 0: its output was not handed back"):
        for _layer in stream.walk(torch.zeros(1, 4, 192)):
            pass


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_a_layer_is_dropped_before_the_next_is_read(tmp_path: Path, default_model: Path) -> None:
    """The loop variable still names the step before when the next layer loads: the walk has
    let go of its layer by then, so only one layer's pages are ever resident."""
    model = make_tiny(tmp_path / "model", default_model, layers=4)
    shard = (model / "model.safetensors").resolve()
    stream = LayerStream(open_checkpoint(model), device="cpu")
    layer_bytes = sum(p.numel() * p.element_size() for p in stream.load_layer(0).parameters())
    previous = None
    for layer in stream.walk(None):
        assert sum(float(p.detach().sum()) for p in layer.module.parameters()) != 0
        assert _resident_bytes_of(shard) <= layer_bytes + 64 * 1024
        layer.advance(None)
        previous = layer
    with pytest.raises(AttributeError):
        previous.module  # noqa: B018
    assert _resident_bytes_of(shard) == 0
