"""The fused RMSNorm gives the same bits as each family's own RMSNorm, and the layer passes use it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from llmq.calib.norm import FUSED_RMS_NORMS, OWN_FORWARD_NORMS, fuse_rms_norms
from llmq.calib.stream import LayerStream
from llmq.io.checkpoint import open_checkpoint
from llmq.io.family import BUILT_AS, FAMILY_LAYOUT


def _family_norm_classes() -> dict[str, type[nn.Module]]:
    """Every RMSNorm class a model of each supported family is built with (on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    classes = {}
    for model_type in FAMILY_LAYOUT:
        config = AutoConfig.for_model(
            BUILT_AS.get(model_type, model_type), num_hidden_layers=1, vocab_size=64, pad_token_id=0
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                classes[type(module).__name__] = type(module)
    return classes


NORM_CLASSES = _family_norm_classes()


def test_every_family_norm_is_fused_or_kept_by_name() -> None:
    assert set(NORM_CLASSES) == FUSED_RMS_NORMS | OWN_FORWARD_NORMS


@pytest.mark.parametrize("name", sorted(FUSED_RMS_NORMS))
@pytest.mark.parametrize("width", [64, 576, 4096])
def test_fused_norm_matches_the_module_bit_for_bit(name: str, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    norm = NORM_CLASSES[name](width, eps=1e-6)
    norm.weight.data = torch.randn(width, generator=generator)
    fused = fuse_rms_norms(copy.deepcopy(norm))
    assert isinstance(fused, NORM_CLASSES[name]) and type(fused).__name__ == f"Fused{name}"
    for magnitude in (1e-3, 1.0, 1e3):
        hidden = torch.randn(3, 37, width, generator=generator) * magnitude
        assert torch.equal(fused(hidden), norm(hidden))


def test_other_dtypes_keep_the_module_forward() -> None:
    norm = NORM_CLASSES["LlamaRMSNorm"](64).to(torch.bfloat16)
    norm.weight.data = torch.linspace(-2, 2, 64, dtype=torch.bfloat16)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    # the fused op would differ here (up to 0.016): bfloat16 rounds between its steps
    assert torch.equal(fuse_rms_norms(copy.deepcopy(norm))(hidden), norm(hidden))


def _all_fused(norms: list[nn.Module]) -> bool:
    return all(type(norm).__name__.startswith("Fused") for norm in norms)


def test_stream_layers_use_the_fused_norm_with_unchanged_outputs(tiny_llama: Path) -> None:
    stream = LayerStream(open_checkpoint(tiny_llama), device="cpu", batch_size=2)
    layer = stream.load_layer(0)
    norms = [
        m for m in layer.modules() if type(m).__name__.removeprefix("Fused") in FUSED_RMS_NORMS
    ]
    assert norms and _all_fused(norms)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 24, stream.config.hidden_size, generator=generator)
    fused = stream.run_layer(layer, hidden)
    for norm in norms:
        norm.__class__ = type(norm).__mro__[1]  # back to the class's own forward
    assert torch.equal(stream.run_layer(layer, hidden), fused)
    assert fuse_rms_norms(layer) is layer and _all_fused(norms)
