"""FP8 block releases (DeepSeek-V3's format: float8_e4m3fn codes and a float32 factor per
128 x 128 block) read as the bfloat16 checkpoints they stand for, and Kimi K2 (DeepSeek-V3's
architecture under its own model_type) built without remote code. The reference for "the
bfloat16 checkpoint" is DeepSeek's fp8_cast_bf16 conversion, transcribed block by block here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.io.checkpoint import open_checkpoint
from tests.conftest import TINY_EXPERTS, assert_bad_input, make_tiny

BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
QUANTIZED = ("_proj.weight", "_mqa.weight")  # the linears DeepSeek's release stores in FP8


def to_release(source: Path, release: Path, **config_changes: object) -> None:
    """DeepSeek's FP8 recipe: per 128 x 128 block, factor = max|w| / 448, codes = w / factor."""
    shutil.copytree(source, release)
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith(QUANTIZED) and tensors[n].dim() == 2]:
        weight = tensors[name].float()
        rows, columns = (-(-d // BLOCK) for d in weight.shape)
        factors = torch.empty(rows, columns)
        codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        for r in range(rows):
            for c in range(columns):
                block = weight[r * BLOCK : (r + 1) * BLOCK, c * BLOCK : (c + 1) * BLOCK]
                factors[r, c] = block.abs().max().clamp(min=1e-12) / 448
                codes[r * BLOCK : (r + 1) * BLOCK, c * BLOCK : (c + 1) * BLOCK] = (block / factors[r, c]).to(torch.float8_e4m3fn)  # fmt: skip
        tensors[name], tensors[f"{name}_scale_inv"] = codes, factors
    save_file(tensors, release / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config.update(quantization_config=FP8_CONFIG, **config_changes)
    (release / "config.json").write_text(json.dumps(config))


def to_bfloat16(release: Path, converted: Path) -> None:
    """fp8_cast_bf16: each block's codes times its factor, in float32, rounded to bfloat16."""
    shutil.copytree(release, converted)
    tensors = load_file(release / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        factors, weight = tensors.pop(name), tensors[name.removesuffix("_scale_inv")]
        out = torch.empty(weight.shape)
        for r in range(factors.shape[0]):
            for c in range(factors.shape[1]):
                rows, columns = slice(r * BLOCK, (r + 1) * BLOCK), slice(c * BLOCK, (c + 1) * BLOCK)
                out[rows, columns] = weight[rows, columns].float() * factors[r, c]
        tensors[name.removesuffix("_scale_inv")] = out.to(torch.bfloat16)
    save_file(tensors, converted / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((release / "config.json").read_text())
    del config["quantization_config"]
    (converted / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> dict[str, Path]:
    """A tiny DeepSeek-V3 in bfloat16 (hidden 192: blocks cut short at the edges), its FP8
    release, that release converted back to bfloat16, and the release as Kimi K2."""
    root = tmp_path_factory.mktemp("fp8-release")
    source = make_tiny(root / "source", default_model, model_type="deepseek_v3", dtype=torch.bfloat16, **TINY_EXPERTS["deepseek_v3"])  # fmt: skip
    to_release(source, root / "release")
    to_bfloat16(root / "release", root / "converted")
    to_release(source, root / "kimi", model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])  # fmt: skip
    return {"release": root / "release", "converted": root / "converted", "kimi": root / "kimi"}


def test_a_release_reads_as_its_bfloat16_conversion(releases: dict[str, Path]) -> None:
    ckpt = open_checkpoint(releases["release"])
    converted = load_file(releases["converted"] / "model.safetensors")
    assert ckpt.quantization_config is None
    assert set(ckpt.tensors) == set(converted)  # the factors hidden
    for name, tensor in converted.items():
        assert ckpt.tensors[name].dtype == {torch.bfloat16: "BF16", torch.float32: "F32"}[tensor.dtype]  # fmt: skip
        assert torch.equal(ckpt.read(name), tensor), name


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantizing_a_release_writes_the_bytes_its_conversion_gives(
    tmp_path: Path, releases: dict[str, Path], method: str
) -> None:
    options = {"scheme": "w4a16", "method": method, "reference": False}
    options.update({"model_free": False} if method == "rtn" else {"num_samples": 4, "seq_len": 32})  # fmt: skip
    for name in ("release", "converted"):
        llmq.quantize(releases[name], tmp_path / name, **options)
    for file in sorted(p.name for p in (tmp_path / "converted").iterdir() if p.name != "llmq.json"):
        assert (tmp_path / "release" / file).read_bytes() == (tmp_path / "converted" / file).read_bytes(), file  # fmt: skip


def test_kimi_k2_is_built_as_deepseek_v3_and_keeps_its_model_type(
    tmp_path: Path, releases: dict[str, Path]
) -> None:
    for name in ("release", "kimi"):
        llmq.quantize(releases[name], tmp_path / name, scheme="w4a16", method="rtn", reference=False)  # fmt: skip
    shards = sorted(p.name for p in (tmp_path / "release").glob("*.safetensors"))
    for shard in shards:
        assert (tmp_path / "kimi" / shard).read_bytes() == (tmp_path / "release" / shard).read_bytes()  # fmt: skip
    kimi = json.loads((tmp_path / "kimi" / "config.json").read_text())
    assert kimi["model_type"] == "kimi_k2" and kimi["architectures"] == ["DeepseekV3ForCausalLM"]
    assert kimi["quantization_config"]["format"] == "pack-quantized"


def test_factors_that_do_not_cover_the_weight_are_refused_in_one_line(
    tmp_path: Path, releases: dict[str, Path]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(releases["release"], broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(app, ["quantize", str(broken), "-o", str(tmp_path / "out")])
    assert_bad_input(result, f"{name} is [1, 2]; blocks of 128 x 128 over [512, 192] need [4, 2]")
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_a_release_converts_to_gguf_as_its_bfloat16_conversion_does(
    tmp_path: Path, releases: dict[str, Path]
) -> None:
    """DeepSeek-V3's and Kimi K2's FP8 releases to GGUF with no converted copy on disk: every
    tensor's bytes those the conversion's GGUF holds (the latent attention split for llama.cpp)."""
    import gguf
    import numpy as np

    files = {}
    for name in ("release", "converted", "kimi"):
        files[name] = tmp_path / f"{name}.gguf"
        llmq.quantize(releases[name], files[name], format="gguf", scheme="q8_0", imatrix="none")
    tensors = {
        name: {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
        for name, path in files.items()
    }
    assert "blk.1.attn_k_b.weight" in tensors["converted"]
    for name in ("release", "kimi"):
        assert tensors[name].keys() == tensors["converted"].keys()
        for tensor, data in tensors["converted"].items():
            assert np.array_equal(tensors[name][tensor], data), (name, tensor)
