"""Model-free conversion (llmq.pipeline.model_free): every tensor written equals the layer
pipeline's byte for byte; a family nobody knows converts, and compressed-tensors' own
decompressors read it back within the scheme's bound; bad input is one line, exit 2; an
interrupted conversion resumes with the shards it finished."""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.errors import OutputError
from llmq.io.stream import StreamedSafetensors
from llmq.pipeline import model_free, model_free_plan, model_free_stream
from tests.conftest import assert_bad_input, make_tiny

DATA_FREE_SCHEMES = [
    "fp8", "fp8-block", "w8a16", "w4a16", "w4a16-asym", "w8a8", "mxfp4a16", "mxfp4", "mxfp8",
    "nvfp4a16",
]  # fmt: skip


def stored(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))
    )


def quantization_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.fixture
def small_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output shards of ~0.2 MB: several per tiny model, so that threads and resume have work;
    weights quantized a few rows at a time (5 to 13 rows here), so that chunks are joined; a
    few weights quantized ahead of the one written, across shard boundaries."""
    monkeypatch.setattr(model_free_plan, "SHARD_BYTES", 200_000)
    monkeypatch.setattr(model_free_stream, "CHUNK_BYTES", 20_000)
    monkeypatch.setattr(model_free_stream, "AHEAD_BYTES", 100_000)


@pytest.mark.parametrize("scheme", DATA_FREE_SCHEMES)
def test_model_free_writes_the_layer_pipelines_bytes(
    tmp_path: Path, tiny_llama_sharded: Path, scheme: str, small_shards: None
) -> None:
    """bf16 weights over several source shards, several output shards on two threads: each
    tensor and the quantization_config equal what the model path writes."""
    free = llmq.quantize(tiny_llama_sharded, tmp_path / "free", scheme=scheme, reference=False)
    assert free.model_free is not None and free.model_free["shards"] > 1
    model = llmq.quantize(
        tiny_llama_sharded, tmp_path / "model", scheme=scheme, skip_layer_check=True,
        reference=False, model_free=False,
    )  # fmt: skip
    assert model.model_free is None
    want, got = stored(tmp_path / "model"), stored(tmp_path / "free")
    assert sorted(got) == sorted(want)
    assert [name for name in want if not same_bytes(got[name], want[name])] == []
    assert quantization_config(tmp_path / "free") == quantization_config(tmp_path / "model")
    assert free.ignored == model.ignored and free.group_size_adjustments == model.group_size_adjustments  # fmt: skip


def test_model_free_writes_every_expert_as_the_layer_pipeline(
    tmp_path: Path, default_model: Path
) -> None:
    """A mixture of experts (Qwen3-MoE): the experts quantized, the router kept, bytes equal."""
    source = make_tiny(tmp_path / "moe", default_model, model_type="qwen3_moe")
    free = llmq.quantize(source, tmp_path / "free", scheme="w4a16", reference=False)
    llmq.quantize(source, tmp_path / "model", scheme="w4a16", skip_layer_check=True, reference=False, model_free=False)  # fmt: skip
    want, got = stored(tmp_path / "model"), stored(tmp_path / "free")
    assert sorted(got) == sorted(want)
    assert all(same_bytes(got[name], want[name]) for name in want)
    assert "model.layers.0.mlp.experts.3.down_proj.weight_packed" in got
    assert "model.layers.0.mlp.gate.weight" in got  # the router, as stored
    assert free.model_free is not None and free.model_free["quantized"] == 2 * (4 + 4 * 3)


def unknown_family(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint of a family neither llmq nor transformers knows: its own module names, a
    router, norms, embeddings and an output head."""
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)

    tensors = {"tok_embeddings.weight": weight(1000, 256), "output.weight": weight(1000, 256)}
    for block in range(2):
        tensors |= {
            f"blocks.{block}.attn.qkv.weight": weight(768, 256),
            f"blocks.{block}.attn.out.weight": weight(256, 256),
            f"blocks.{block}.attn_norm.weight": weight(256),
            f"blocks.{block}.moe.router.weight": weight(4, 256),
            f"blocks.{block}.moe.experts.0.fc1.weight": weight(512, 256),
            f"blocks.{block}.moe.experts.0.fc2.weight": weight(256, 512),
        }
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    config = {"model_type": "made-up-transformer", "architectures": ["MadeUpForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def decompressed(folder: Path, module: str) -> torch.Tensor:
    """A module's weight as compressed-tensors' own decompressor reads it from the files."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    config = quantization_config(folder)
    (group,) = config["config_groups"].values()
    scheme = QuantizationScheme(**group)
    files = stored(folder)
    state = {k[len(module) + 1 :]: v for k, v in files.items() if k.startswith(module + ".")}
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    return compressor.decompress(state, scheme)["weight"].float()


@pytest.mark.parametrize("scheme", ["w4a16", "fp8", "mxfp4a16"])
def test_an_unknown_family_converts_model_free(tmp_path: Path, scheme: str) -> None:
    """The linear-looking 2-D weights are quantized, within the scheme's bound as compressed-
    tensors decompresses them; embeddings, head, norms and routers are written as stored."""
    source = tmp_path / "made-up"
    original = unknown_family(source)
    # min/max ranges (no clip search): every weight within the bound, none clipped
    result = llmq.quantize(source, tmp_path / "out", scheme=scheme, clip="none")
    assert result.model_free is not None and result.model_free["quantized"] == 8
    files = stored(tmp_path / "out")
    for name in ("tok_embeddings.weight", "output.weight", "blocks.1.attn_norm.weight", "blocks.1.moe.router.weight"):  # fmt: skip
        assert same_bytes(files[name], original[name])
    for block in range(2):
        for module in ("attn.qkv", "attn.out", "moe.experts.0.fc1", "moe.experts.0.fc2"):
            name = f"blocks.{block}.{module}"
            weight = original[f"{name}.weight"].float()
            error = (decompressed(tmp_path / "out", name) - weight).abs()
            if scheme == "fp8":  # e4m3: 3 mantissa bits, so within 2^-4 of each value's scale
                scale = files[f"{name}.weight_scale"].float()
                assert bool((error <= weight.abs() / 16 + scale * 2**-9 + 1e-3).all())
            elif scheme == "mxfp4a16":  # e2m1: half its widest step (4 to 6) of the group's scale
                scale = files[f"{name}.weight_scale"].view(torch.float8_e8m0fnu).float()
                assert bool((error <= scale.repeat_interleave(32, dim=1) + 1e-6).all())
            else:  # int4 per group: half a step, and the bf16 rounding of the decompressed value
                scale = files[f"{name}.weight_scale"].float()
                step = scale.repeat_interleave(weight.shape[1] // scale.shape[1], dim=1)
                assert bool((error <= 0.5 * step + weight.abs() * 2**-8 + 1e-6).all())
    record = json.loads((tmp_path / "out" / "llmq.json").read_text())
    assert record["model_free"]["targets"] == "every 2-D linear weight"
    assert "reference" not in record  # no layout: `verify` checks hashes alone


def test_nvfp4_of_a_family_llmq_cannot_lay_out_is_refused_model_free(tmp_path: Path) -> None:
    """NVFP4's fused sets share a global scale: without the family's layout, no set is known."""
    source = tmp_path / "made-up"
    unknown_family(source)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(source), "--out", str(out), "--scheme", "nvfp4a16", "--model-free"])  # fmt: skip
    assert_bad_input(result, "--model-free: NVFP4 gives the linears vLLM fuses (q/k/v, gate/up) one global scale, and llmq does not know which of model_type 'made-up-transformer'")  # fmt: skip
    assert not out.exists()


def test_targets_choose_the_quantized_weights(tmp_path: Path) -> None:
    source = tmp_path / "made-up"
    unknown_family(source)
    llmq.quantize(source, tmp_path / "out", scheme="w8a16", targets=("re:.*experts",))
    files = stored(tmp_path / "out")
    assert "blocks.0.moe.experts.0.fc1.weight_packed" in files
    assert "blocks.0.attn.qkv.weight" in files  # not a target: as stored


def test_a_model_free_run_resumes_with_the_shards_it_finished(
    tmp_path: Path, tiny_llama_sharded: Path, small_shards: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk on the third shard: the finished shards are kept, --resume writes the rest
    without rewriting them, and the result equals an uninterrupted run's."""
    out = tmp_path / "out"
    real_stream = model_free.streamed_safetensors
    saved: list[Path] = []

    @contextmanager
    def full_disk_on_third(path: Path, room: int) -> Iterator[StreamedSafetensors]:
        saved.append(path)
        with real_stream(path, room) as out:
            yield out
            if len(saved) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model_free, "streamed_safetensors", full_disk_on_third)
    with pytest.raises(OutputError):
        llmq.quantize(tiny_llama_sharded, out, scheme="w4a16", reference=False)
    monkeypatch.setattr(model_free, "streamed_safetensors", real_stream)
    staging = out.parent / f".{out.name}.llmq-partial"
    kept = {path.name: path.stat().st_mtime_ns for path in staging.glob("model-*.safetensors")}
    assert len(kept) == 2
    result = llmq.quantize(tiny_llama_sharded, out, scheme="w4a16", reference=False, resume=True)
    assert result.resumed_layers == 2
    assert all((out / name).stat().st_mtime_ns == stamp for name, stamp in kept.items())
    llmq.quantize(tiny_llama_sharded, tmp_path / "whole", scheme="w4a16", reference=False)
    want, got = stored(tmp_path / "whole"), stored(out)
    assert sorted(got) == sorted(want) and all(same_bytes(got[n], want[n]) for n in want)


def test_the_default_picks_the_path_the_recipe_allows(tmp_path: Path, tiny_llama: Path) -> None:
    """Plain rtn converts model-free; a calibrated method runs the layer pipeline."""
    rtn = llmq.quantize(tiny_llama, tmp_path / "rtn", scheme="w8a16", reference=False)
    assert rtn.model_free is not None and rtn.layers == []
    gptq = llmq.quantize(tiny_llama, tmp_path / "gptq", scheme="w8a16", method="gptq", num_samples=2, seq_len=16, reference=False)  # fmt: skip
    assert gptq.model_free is None and len(gptq.layers) == 2


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--model-free", "--method", "gptq"], "--model-free: --method gptq calibrates"),
        (["--model-free", "--kv-cache", "fp8"], "--model-free: static activation scales"),
        (["--model-free", "--scheme", "nvfp4"], "--model-free: static activation scales, NVFP4"),
        (["--targets", "nothing_like_it"], "--targets 'nothing_like_it': matches none"),
        (["--targets", "re:["], "--targets 're:[': invalid regular expression"),
        (["--targets", "q_proj", "--no-model-free"], "drop --no-model-free"),
        (["--targets", "q_proj", "--method", "awq"], "--targets (model-free): --method awq"),
        (["--model-free", "--num-samples", "4"], "--num-samples: model-free conversion reads no"),
    ],
)
def test_bad_model_free_input_is_one_line(
    tmp_path: Path, tiny_llama: Path, flags: list[str], fragment: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "--out", str(out), *flags])
    assert_bad_input(result, fragment)
    assert not out.exists() and not (tmp_path / ".out.llmq-partial").exists()
