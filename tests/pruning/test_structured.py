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
from llmq.errors import InputError
from llmq.io.family import FAMILY_LAYOUT
from llmq.pruning.structured import (
    BUDGET_CHANNELS,
    Importance,
    Targets,
    budget_targets,
    count_parameters,
    pruned_config,
)
from tests.conftest import TOKENIZER_FILES, assert_bad_input, make_tiny, sharpen

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


@pytest.mark.parametrize(
    "model_type", sorted(name for name, layout in FAMILY_LAYOUT.items() if layout.structured)
)
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
        (
            ["--intermediate-size", "0"],
            "--intermediate-size 0: Input should be greater than or equal to 1",
        ),
        (["--params", "0"], "--params 0.0: Input should be greater than 0"),
        (["--params", "1.5"], "--params 1.5: Input should be less than 1"),
        (["--params", "0.5", "--intermediate-size", "128"], "not both"),
        (["--params", "0.5", "--decoder-params", "0.5"], "give one"),
        (["--decoder-params", "1"], "--decoder-params 1.0: Input should be less than 1"),
        (["--params", "0.05"], "narrowing the MLP keeps at least"),
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


LAYERS = "model.layers"


def budget_step(config: dict, part: str, source: int) -> float:
    """The share of `source` parameters ("total" or "decoder") that one rounding step of a
    budget's MLP width holds in a model of `config`."""

    def count(channels: int) -> int:
        return getattr(count_parameters({**config, "intermediate_size": channels}, LAYERS), part)

    inter = config["intermediate_size"]
    return (count(inter) - count(inter - BUDGET_CHANNELS)) / source


@pytest.mark.parametrize("decoder", [False, True], ids=["params", "decoder-params"])
def test_a_budget_is_met_within_one_step_below_on_the_default_models_shapes(
    default_model: Path, decoder: bool
) -> None:
    """SmolLM2-135M's own config, counted on the meta device: --params counts every parameter
    (the tied embedding once), --decoder-params the decoder layers'."""
    config = json.loads((default_model / "config.json").read_text())
    part = "decoder" if decoder else "total"
    source = getattr(count_parameters(config, LAYERS), part)
    assert count_parameters(config, LAYERS).total == 134_515_008
    step = budget_step(config, part, source)
    for share in (0.5, 0.6, 0.75, 0.9):
        targets = budget_targets(config, LAYERS, share, decoder=decoder)
        assert targets.intermediate_size % BUDGET_CHANNELS == 0
        kept = getattr(count_parameters(pruned_config(config, targets), LAYERS), part)
        assert 0 <= share - kept / source < step, share
    # 1024 channels keep 75.008% of the decoder (its norms too), so 960 is the widest that fits
    assert budget_targets(config, LAYERS, 0.75, decoder=decoder).intermediate_size == (960 if decoder else 832)  # fmt: skip


def test_an_unreachable_budget_says_what_is_reachable(default_model: Path) -> None:
    config = json.loads((default_model / "config.json").read_text())
    with pytest.raises(InputError) as caught:
        budget_targets(config, LAYERS, 0.3)
    assert caught.value.message == (
        "--params 0.3: narrowing the MLP keeps at least 43.3% of the model's 134.5M parameters "
        "(embeddings 21.0%, attention and norms 19.8%)"
    )
    assert "--hidden-size" in str(caught.value.hint)
    # as the hint says: with the hidden size given, the budget sizes the MLP around it
    narrow = pruned_config(config, budget_targets(config, LAYERS, 0.3, given=Targets(hidden_size=288)))  # fmt: skip
    kept = count_parameters(narrow, LAYERS).total
    assert narrow["hidden_size"] == 288
    assert 0 <= 0.3 - kept / 134_515_008 < budget_step(narrow, "total", 134_515_008)


def small_vocabulary_model(folder: Path, tokenizer_from: Path, *, tied: bool) -> Path:
    """A tiny Llama whose embedding is as small a share as the default model's (a 49k vocabulary
    would be 90% of a tiny model): 1024 tokens (2048 tied), hidden 192, MLP 1024, 4 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048 if tied else 1024, hidden_size=192, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
        tie_word_embeddings=tied,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes((tokenizer_from / name).read_bytes())
    return folder


def random_importance(path: Path, config: dict) -> Path:
    layers, generator = config["num_hidden_layers"], torch.Generator().manual_seed(0)

    def scores(n: int) -> list[torch.Tensor]:
        return [torch.rand(n, generator=generator) for _ in range(layers)]

    Importance(
        scores(config["intermediate_size"]), scores(config["num_key_value_heads"]),
        scores(config["num_attention_heads"]), torch.rand(layers, dtype=torch.float64),
        torch.rand(config["hidden_size"]),
    ).save(path)  # fmt: skip
    return path


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("option", ["--params", "--decoder-params"])
def test_the_written_model_keeps_the_budgets_share(
    tmp_path: Path, default_model: Path, tied: bool, option: str
) -> None:
    """Through the CLI: the checkpoint transformers loads holds at most the share asked for,
    within one step of the MLP's width; the report and llmq.json give both counts, before and
    after."""
    model = small_vocabulary_model(tmp_path / "model", default_model, tied=tied)
    config = json.loads((model / "config.json").read_text())
    scores = random_importance(tmp_path / "scores.safetensors", config)
    out = tmp_path / "out"
    args = ["prune", str(model), "--out", str(out), "--structured", option, "0.6",
            "--importance", str(scores), "--no-evaluate", "--no-reference", "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    part = "decoder" if option == "--decoder-params" else "total"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    total = sum(p.numel() for p in loaded.parameters())  # a tied lm_head once
    decoder = sum(p.numel() for n, p in loaded.named_parameters() if n.startswith(f"{LAYERS}."))
    assert report["parameters"]["output"] == total
    assert report["decoder_parameters"]["output"] == decoder
    source = report["parameters" if part == "total" else "decoder_parameters"]["source"]
    kept = total if part == "total" else decoder
    assert 0 <= 0.6 - kept / source < budget_step(config, part, source)
    assert report["budget"] == {"option": option, "share": 0.6, "reached": kept / source}
    record = json.loads((out / "llmq.json").read_text())["structured"]
    assert record["parameters"]["output"] == {"total": total, "decoder": decoder}
    assert record["parameters"]["source"] == {
        "total": report["parameters"]["source"], "decoder": report["decoder_parameters"]["source"]
    }  # fmt: skip
    assert record["budget"] == report["budget"]
