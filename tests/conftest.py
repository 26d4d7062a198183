"""Shared fixtures: tiny random models of each supported family (mechanics) and the real
default model (accuracy). Tiny models reuse the default model's tokenizer so that calibration
runs on real text."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter. It is chosen when a
# kernel is decorated, so before any test imports llmq.kernels.w4a16 / w8a8.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def default_model() -> Path:
    from llmq.models import builtin_model_path

    return builtin_model_path("smollm2-135m")


def make_tiny(
    dest: Path,
    tokenizer_from: Path,
    *,
    model_type: str = "llama",
    hidden: int = 192,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    shards: str | None = None,
    kv_heads: int = 1,
    heads: int = 3,
    tied: bool = True,
) -> Path:
    """A small random decoder of `model_type`, saved as a Hugging Face folder.

    hidden 192 is not divisible by 128 (like SmolLM2's 576), so the group-size fallback runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Give the weights a realistic scale and a few outlier channels.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0, 0.05)
                param[:, :3] *= 8
    kwargs = {"max_shard_size": shards} if shards else {}
    model.save_pretrained(dest, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, dest / name)
    return dest


def sharpen(folder: Path) -> Path:
    """Scale a tiny model's tied embedding up so that its next-token distributions are peaked:
    a random model's logits are nearly uniform over the 49k tokens, so that nothing done to it
    changes its perplexity much (distillation and gates need a model with something to lose)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.embed_tokens.weight"] *= 25
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "llama", default_model)


@pytest.fixture(scope="session")
def tiny_llama_sharded(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return make_tiny(
        tmp_path_factory.mktemp("tiny") / "llama-sharded",
        default_model,
        dtype=torch.bfloat16,
        shards="5MB",
    )


def assert_bad_input(result, fragment: str) -> None:
    """A CLI result that refused bad input: exit 2, one `error:` line naming it, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "error:" in result.output and fragment in result.output
