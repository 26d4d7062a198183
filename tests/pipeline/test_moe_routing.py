"""Mixtures of experts: which calibration tokens reach which expert. The coverage report counts
what the model's own router does; `--moe-calibration routed` calibrates each expert on its
routed tokens only, and an expert no token reaches is rounded to nearest, said so, not failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import llmq
from llmq.calib.collect import run_observed
from llmq.calib.data import calibration_windows
from llmq.calib.experts import take_routed_tokens
from llmq.calib.stream import LayerStream
from llmq.calib.tokenizer import load_tokenizer
from llmq.cli.main import app
from llmq.io.checkpoint import open_checkpoint
from tests.conftest import assert_bad_input, make_tiny

SAMPLES, SEQ_LEN = 4, 32
CALIBRATION = {"num_samples": SAMPLES, "seq_len": SEQ_LEN, "reference": False}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return make_tiny(tmp_path_factory.mktemp("moe") / "qwen3-moe", default_model, model_type="qwen3_moe")  # fmt: skip


@pytest.fixture(scope="module")
def two_idle_experts(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """One expert a token, router rows [a, -a, 0, 0]: |a.x| > 0 beats experts 2 and 3 on every
    token, so no token ever reaches them."""
    folder = make_tiny(tmp_path_factory.mktemp("moe") / "idle", default_model,
                       model_type="qwen3_moe", num_experts_per_tok=1)  # fmt: skip
    tensors = load_file(folder / "model.safetensors")
    for layer in range(2):
        router = tensors[f"model.layers.{layer}.mlp.gate.weight"]
        router[1] = -router[0]
        router[2:] = 0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_the_coverage_report_counts_what_the_models_router_picks(moe: Path, tmp_path: Path) -> None:  # fmt: skip
    """Layer 0 reads the embeddings, so its counts are those of transformers' own router on the
    same calibration windows (each token once for each of its two experts)."""
    result = llmq.quantize(moe, tmp_path / "out", scheme="w8a16", **CALIBRATION)
    ids = calibration_windows(load_tokenizer(moe), "shakespeare+pydoc", num_samples=SAMPLES,
                              seq_len=SEQ_LEN, seed=0).input_ids  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    picked: list[torch.Tensor] = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
    with torch.no_grad():
        model(ids)
    expected = torch.bincount(torch.cat(picked).flatten(), minlength=4).tolist()
    assert result.layers[0].expert_tokens == expected
    assert all(sum(layer.expert_tokens) == SAMPLES * SEQ_LEN * 2 for layer in result.layers)


def test_routed_calibration_gives_each_expert_its_routed_tokens(moe: Path) -> None:
    stream = LayerStream(open_checkpoint(moe), expert_tokens="routed")
    layer = stream.load_layer(0)
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    _, stats = run_observed(stream, layer, list(stream.layout.linears), stream.embed(ids), hessian=True)  # fmt: skip
    routed = take_routed_tokens(layer)
    assert routed is not None and sum(routed) == ids.numel() * 2
    for e, tokens in enumerate(routed):
        gate, up, down = (stats[f"mlp.experts.{e}.{r}"] for r in ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
        assert gate is up and gate.num_tokens == down.num_tokens == tokens
    assert len({id(stats[f"mlp.experts.{e}.gate_proj"]) for e in range(4)}) == 4


def test_an_expert_no_token_reaches_is_rounded_and_flagged(two_idle_experts: Path, tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "gptq"
    run = CliRunner().invoke(app, ["quantize", str(two_idle_experts), "--out", str(out), "--method", "gptq",
                                   "--moe-calibration", "routed", "--num-samples", str(SAMPLES),
                                   "--seq-len", str(SEQ_LEN), "--no-reference", "--json"])  # fmt: skip
    assert run.exit_code == 0, run.output
    result = json.loads(run.stdout)
    for layer in result["layers"]:
        assert layer["expert_tokens"][2:] == [0, 0] and sum(layer["expert_tokens"]) == SAMPLES * SEQ_LEN  # fmt: skip
        warned = {linear["name"].split(".", 3)[-1] for linear in layer["linears"] if linear["warning"]}  # fmt: skip
        assert warned == {f"mlp.experts.{e}.{r}" for e in (2, 3) for r in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    table = CliRunner().invoke(app, ["quantize", str(two_idle_experts), "--out", str(tmp_path / "rtn"),
                                     "--scheme", "w8a16", "--num-samples", "2", "--seq-len", str(SEQ_LEN),
                                     "--no-reference"])  # fmt: skip
    assert table.exit_code == 0, table.output
    printed = " ".join(table.output.split())  # as wrapped at any terminal width
    assert "4 experts under 10% of an even share" in printed
    assert "warning: layer 1 expert 3: 0 tokens routed" in printed


def test_routed_calibration_refuses_a_scale_search_over_all_experts(moe: Path, tmp_path: Path) -> None:  # fmt: skip
    run = CliRunner().invoke(app, ["quantize", str(moe), "--out", str(tmp_path / "o"), "--method", "awq",
                                   "--moe-calibration", "routed"])  # fmt: skip
    assert_bad_input(run, "moe_calibration routed: AWQ and SmoothQuant")
    unknown = CliRunner().invoke(app, ["quantize", str(moe), "--out", str(tmp_path / "o"),
                                       "--moe-calibration", "some"])  # fmt: skip
    assert_bad_input(unknown, "--moe-calibration some: Input should be 'all' or 'routed'")
    assert not (tmp_path / "o").exists()


GPT_OSS = {
    "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 8,
}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "scheme", "fields"),
    [("qwen3_moe", "w4a16", {}), ("gpt_oss", "mxfp4a16", GPT_OSS)],  # GPT-OSS: fused back
)
def test_an_interrupted_mixture_of_experts_run_resumes_to_the_same_files(
    tmp_path: Path, default_model: Path, family: str, scheme: str, fields: dict
) -> None:
    """GPTQ with the coverage count: stopped after two of four layers, resumed from there."""
    from tests.pipeline.test_quantize import InterruptAfter, checkpoint_bytes

    model = make_tiny(tmp_path / "model", default_model, model_type=family, layers=4, **fields)
    job = {"scheme": scheme, "method": "gptq", **CALIBRATION}
    whole = llmq.quantize(model, tmp_path / "whole", **job)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        llmq.quantize(model, out, progress=InterruptAfter(2), resume_every_s=0, **job)
    resumed = llmq.quantize(model, out, resume=True, **job)
    assert resumed.resumed_layers == 2
    assert checkpoint_bytes(out) == checkpoint_bytes(tmp_path / "whole")
    assert [layer.expert_tokens for layer in resumed.layers] == [layer.expert_tokens for layer in whole.layers]  # fmt: skip


def test_experts_are_solved_in_stacks_of_bounded_rows_with_the_same_result(
    moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All experts' gates and ups share one input; they are stacked for GPTQ at most
    MAX_STACKED_ROWS rows at a time (rows are solved independently: the same codes)."""
    from llmq.pipeline import linears

    job = {"scheme": "w4a16", "method": "gptq", **CALIBRATION}
    llmq.quantize(moe, tmp_path / "one-stack", **job)
    monkeypatch.setattr(linears, "MAX_STACKED_ROWS", 300)  # 128 rows a linear: stacks of two
    sizes: list[int] = []
    original = linears._quantize_stack
    monkeypatch.setattr(linears, "_quantize_stack", lambda m, w, *a: sizes.append(sum(len(x) for x in w)) or original(m, w, *a))  # fmt: skip
    llmq.quantize(moe, tmp_path / "stacks", **job)
    assert max(sizes) <= 300 and sizes.count(256) >= 8  # 4 experts x (gate, up) in pairs, 2 layers
    for shard in sorted((tmp_path / "one-stack").glob("*.safetensors")):
        ours, theirs = load_file(shard), load_file(tmp_path / "stacks" / shard.name)
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)
