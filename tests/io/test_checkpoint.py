"""Checkpoint reading: shards, index, lazy reads, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmq.errors import InputError, UnsupportedModelError
from llmq.io.checkpoint import open_checkpoint
from llmq.io.family import FAMILY_LAYOUT


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_sharded_bf16_checkpoint_reads_lazily(tiny_llama_sharded: Path) -> None:
    ckpt = open_checkpoint(tiny_llama_sharded)
    shards = {info.shard.name for info in ckpt.tensors.values()}
    assert len(shards) > 1 and (tiny_llama_sharded / "model.safetensors.index.json").is_file()
    assert ckpt.tied_embeddings
    w = ckpt.read("model.layers.1.mlp.down_proj.weight")
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == (192, 512)


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such folder"):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(InputError, match=r"no config\.json"):
        open_checkpoint(tmp_path)


def test_unsupported_architecture_names_supported_ones(tmp_path: Path, tiny_llama: Path) -> None:
    model = copy_model(tiny_llama, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        open_checkpoint(model)
    assert "gpt_neox" in info.value.message
    assert all(family in (info.value.hint or "") for family in FAMILY_LAYOUT)


def test_truncated_safetensors(tmp_path: Path, tiny_llama: Path) -> None:
    model = copy_model(tiny_llama, tmp_path / "m")
    shard = model / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="outside the"):
        open_checkpoint(model)
    shard.write_bytes(data[:5])
    with pytest.raises(InputError, match="truncated"):
        open_checkpoint(model)


def test_corrupt_headers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(InputError, match="header length"):
        open_checkpoint(tmp_path)
    shard.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(InputError, match="not valid JSON"):
        open_checkpoint(tmp_path)
    save_file({"a": torch.zeros(4)}, str(shard))
    raw = bytearray(shard.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + header_len])
    header["a"]["data_offsets"] = [0, 64]  # beyond the 16-byte data section
    encoded = json.dumps(header).encode().ljust(header_len)
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + header_len :])
    with pytest.raises(InputError, match="offsets"):
        open_checkpoint(tmp_path)


def test_shard_listed_in_index_but_missing(tmp_path: Path, tiny_llama_sharded: Path) -> None:
    model = copy_model(tiny_llama_sharded, tmp_path / "m")
    victim = sorted(model.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(InputError, match=r"listed in model\.safetensors\.index\.json but missing"):
        open_checkpoint(model)


def test_broken_links_are_named(tmp_path: Path, tiny_llama: Path, tiny_llama_sharded: Path) -> None:
    """A hub cache snapshot whose blob download was interrupted: the link says where it points."""
    single = copy_model(tiny_llama, tmp_path / "single")
    (single / "model.safetensors").unlink()
    (single / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(
        InputError, match=r"model\.safetensors: a broken symbolic link to .*blobs/gone$"
    ):
        open_checkpoint(single)
    sharded = copy_model(tiny_llama_sharded, tmp_path / "sharded")
    victim = sorted(sharded.glob("*.safetensors"))[-1]
    victim.unlink()
    victim.symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(
        InputError, match=r"listed in model\.safetensors\.index\.json but a broken symbolic link"
    ):
        open_checkpoint(sharded)


def test_mapped_tensors_equal_safetensors_reads_and_never_write_the_file(tmp_path: Path) -> None:
    from safetensors import safe_open

    from llmq.io.checkpoint import mapped_safetensors, read_safetensors_header

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=generator),
        "bf16": torch.randn(7, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(2, 3, 4, generator=generator).to(torch.float16),
        "fp8": torch.randn(9, generator=generator).to(torch.float8_e4m3fn),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "u8": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    before = path.read_bytes()
    entries = read_safetensors_header(path)
    with mapped_safetensors(path) as read, safe_open(str(path), framework="pt") as reference:
        for name, entry in entries.items():
            mapped = read(entry)
            assert mapped.dtype == tensors[name].dtype and mapped.shape == tensors[name].shape
            assert torch.equal(
                mapped.view(torch.uint8), reference.get_tensor(name).view(torch.uint8)
            )
        read(entries["f32"]).fill_(0.0)  # a private copy of the page: the file keeps its bytes
        kept = read(entries["i32"])
    assert path.read_bytes() == before
    assert torch.equal(kept, tensors["i32"])  # outlives the block: the mapping stays until freed
