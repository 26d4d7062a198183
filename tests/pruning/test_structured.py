"""`llmq prune --structured`: a smaller dense model that plain transformers reloads with the
logits llmq's evaluator recorded, parts left whole untouched, key-value groups kept whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.pruning.structured import Importance
from tests.conftest import assert_bad_input, make_tiny, sharpen

runner = CliRunner()
CALIB = {"num_samples": 4, "seq_len": 64, "evaluate": False}


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """4 query heads in 2 key-value groups, 3 layers."""
    folder = tmp_path_factory.mktemp("gqa") / "model"
    return make_tiny(folder, default_model, hidden=256, layers=3, kv_heads=2, heads=4)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in folder.glob("*.safetensors"):
        found.update(load_file(path))
    return found


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_axis_reloads_in_transformers_with_the_recorded_logits(
    tmp_path: Path, default_model: Path, model_type: str
) -> None:
    model = make_tiny(tmp_path / "model", default_model, model_type=model_type, hidden=256,
                      layers=3, kv_heads=2, heads=4)  # fmt: skip
    out = tmp_path / "out"
    result = llmq.prune_structured(
        model, out, intermediate_size=128, num_kv_heads=1, num_layers=2, **CALIB
    )
    loaded = AutoModelForCausalLM.from_pretrained(out)
    config = loaded.config
    assert (config.num_hidden_layers, config.intermediate_size) == (2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 64)
    assert loaded.model.layers[1].self_attn.q_proj.weight.shape == (128, 256)
    assert sum(p.numel() for p in loaded.parameters()) == result.parameters["output"]
    verified = llmq.verify(out, loaders=["transformers"])
    assert verified.passed and verified.loaders[0].comparison.distance.max_abs == 0
    record = json.loads((out / "llmq.json").read_text())["structured"]
    assert record["removed"]["intermediate_size"] == [512, 128]
    assert len(record["removed"]["layers"]) == 1


def test_parts_left_whole_are_untouched_and_groups_stay_whole(
    tmp_path: Path, gqa_model: Path
) -> None:
    scores = tmp_path / "scores.safetensors"
    llmq.prune_structured(gqa_model, tmp_path / "mlp", intermediate_size=128, save_importance=scores, **CALIB)  # fmt: skip
    source, mlp = weights(gqa_model), weights(tmp_path / "mlp")
    importance = Importance.load(scores)
    for name, tensor in source.items():
        if ".mlp." not in name:  # attention, norms, embeddings: bit for bit
            assert torch.equal(mlp[name], tensor), name
    kept = importance.channels[0].argsort(descending=True)[:128].sort().values
    torch.testing.assert_close(mlp["model.layers.0.mlp.down_proj.weight"], source["model.layers.0.mlp.down_proj.weight"][:, kept], rtol=0, atol=0)  # fmt: skip
    # one key-value group of two: its two query heads go with it, the MLP stays as it was
    llmq.prune_structured(gqa_model, tmp_path / "kv", num_kv_heads=1, importance=scores, **CALIB)
    kv = weights(tmp_path / "kv")
    for layer in range(3):
        prefix = f"model.layers.{layer}."
        group = int(importance.kv_groups[layer].argmax())
        q = source[prefix + "self_attn.q_proj.weight"]
        torch.testing.assert_close(kv[prefix + "self_attn.q_proj.weight"], q[group * 128 : (group + 1) * 128], rtol=0, atol=0)  # fmt: skip
        k = source[prefix + "self_attn.k_proj.weight"]
        torch.testing.assert_close(kv[prefix + "self_attn.k_proj.weight"], k[group * 64 : (group + 1) * 64], rtol=0, atol=0)  # fmt: skip
        assert torch.equal(kv[prefix + "mlp.up_proj.weight"], source[prefix + "mlp.up_proj.weight"])


@pytest.mark.parametrize("tied", [True, False])
def test_hidden_channels_go_everywhere_at_once_and_the_silent_ones_first(
    tmp_path: Path, default_model: Path, tied: bool
) -> None:
    """64 hidden channels that both norms of every layer zero are the ones removed; the
    embedding, lm_head, norms and every linear lose the same ones, and transformers reloads the
    result with the logits llmq recorded."""
    model = make_tiny(tmp_path / "model", default_model, layers=2, heads=4, tied=tied)
    tensors = load_file(model / "model.safetensors")
    silent = torch.arange(64, 128)
    for name, tensor in tensors.items():
        if name.endswith("layernorm.weight"):
            tensor[silent] = 0.0
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    llmq.prune_structured(model, out, hidden_size=128, **CALIB)
    kept = torch.cat([torch.arange(64), torch.arange(128, 192)])
    written = weights(out)
    embed = tensors["model.embed_tokens.weight"]
    assert torch.equal(written["model.embed_tokens.weight"], embed[:, kept])
    assert ("lm_head.weight" in written) == (not tied)
    if not tied:
        assert torch.equal(written["lm_head.weight"], tensors["lm_head.weight"][:, kept])
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(written["model.layers.1.self_attn.q_proj.weight"], q[:, kept])
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(written["model.layers.0.mlp.down_proj.weight"], down[kept])
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.hidden_size == 128 and loaded.config.head_dim == 64
    verified = llmq.verify(out, loaders=["transformers"])
    assert verified.passed and verified.loaders[0].comparison.distance.max_abs == 0


def test_each_group_keeps_its_most_important_query_heads(tmp_path: Path, gqa_model: Path) -> None:
    scores = tmp_path / "scores.safetensors"
    out = tmp_path / "heads"
    llmq.prune_structured(gqa_model, out, num_heads=2, save_importance=scores, **CALIB)
    source, written, importance = weights(gqa_model), weights(out), Importance.load(scores)
    for layer in range(3):
        prefix = f"model.layers.{layer}.self_attn."
        best = [g * 2 + int(importance.heads[layer][g * 2 : g * 2 + 2].argmax()) for g in (0, 1)]
        rows = torch.cat([torch.arange(h * 64, (h + 1) * 64) for h in best])
        assert torch.equal(written[prefix + "q_proj.weight"], source[prefix + "q_proj.weight"][rows])  # fmt: skip
        assert torch.equal(written[prefix + "o_proj.weight"], source[prefix + "o_proj.weight"][:, rows])  # fmt: skip
        assert torch.equal(written[prefix + "k_proj.weight"], source[prefix + "k_proj.weight"])
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 2)
    assert llmq.verify(out, loaders=["transformers"]).passed


def test_dropping_an_identity_layer_changes_no_perplexity(
    tmp_path: Path, default_model: Path
) -> None:
    """A layer whose o_proj and down_proj are zero adds nothing to the residual stream: the
    ppl depth metric scores it exactly 0, the others not; and prune uses that metric."""
    from llmq.io.checkpoint import open_checkpoint
    from llmq.pruning.structured import depth_by_perplexity

    model = sharpen(make_tiny(tmp_path / "model", default_model, layers=3))
    tensors = load_file(model / "model.safetensors")
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        tensors[f"model.layers.1.{name}.weight"].zero_()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    scores = depth_by_perplexity(open_checkpoint(model), ids)
    assert scores[1].item() == 0.0
    assert scores[0].item() != 0.0 and scores[2].item() != 0.0
    out = tmp_path / "out"
    result = llmq.prune_structured(model, out, num_layers=2, depth_metric="ppl", **CALIB)
    assert result.importance == "computed, layers by perplexity"
    removed = json.loads((out / "llmq.json").read_text())["structured"]["removed"]["layers"]
    from llmq.calib.data import calibration_windows
    from llmq.calib.tokenizer import load_tokenizer

    windows = calibration_windows(load_tokenizer(model), "shakespeare+pydoc", num_samples=4, seq_len=64, seed=0)  # fmt: skip
    assert removed == [int(depth_by_perplexity(open_checkpoint(model), windows.input_ids).argmin())]


def test_saved_scores_give_the_same_checkpoint(tmp_path: Path, gqa_model: Path) -> None:
    scores = tmp_path / "scores.safetensors"
    targets = {"intermediate_size": 256, "num_layers": 2}
    llmq.prune_structured(gqa_model, tmp_path / "a", save_importance=scores, **targets, **CALIB)
    llmq.prune_structured(gqa_model, tmp_path / "b", importance=scores, **targets, **CALIB)
    assert weights(tmp_path / "a").keys() == weights(tmp_path / "b").keys()
    for name, tensor in weights(tmp_path / "a").items():
        assert torch.equal(tensor, weights(tmp_path / "b")[name]), name


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--num-layers", "9"], "the model has 3"),
        (["--hidden-size", "300"], "the model has 256"),
        (["--hidden-size", "250"], "multiple of the 4 attention heads"),
        (["--num-heads", "3"], "does not divide into the 2 key-value groups"),
        (["--intermediate-size", "0"], "keep between 1 and 512"),
        (["--params", "0"], "a share of the parameters in (0, 1)"),
        (["--params", "1.5"], "a share of the parameters in (0, 1)"),
        (["--params", "0.5", "--num-layers", "2"], "not both"),
        (["--sparsity", "0.5"], "--structured removes whole channels"),
        ([], "nothing to remove"),
    ],
)
def test_bad_structured_options_exit_2_before_any_work(
    tmp_path: Path, gqa_model: Path, options: list[str], fragment: str
) -> None:
    out = tmp_path / "o"
    result = runner.invoke(app, ["prune", str(gqa_model), "--out", str(out), "--structured", *options])  # fmt: skip
    assert_bad_input(result, fragment)
    assert list(tmp_path.iterdir()) == []
