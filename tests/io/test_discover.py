"""Decoders the family table does not list: a layout found from transformers' module tree, and
what the stream then computes equals transformers' own model; what it cannot handle is refused
in one line naming what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.errors import InputError, UnsupportedModelError
from llmq.eval.logits import evaluator_log_probs
from llmq.io.checkpoint import open_checkpoint
from llmq.io.family import FAMILY_LAYOUT
from tests.conftest import assert_bad_input, make_tiny

IDS = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
FAST = {"num_samples": 4, "seq_len": 32, "reference": False}
# What each family's layout must pair (norm -> the first linear it feeds), as its code reads:
FOUND = {
    "olmo2": [],  # norms after the blocks only (and q/k norms): nothing to fold into
    "gpt_neox": [("input_layernorm", "attention.query_key_value"),  # LayerNorm with a bias,
                 ("post_attention_layernorm", "mlp.dense_h_to_4h")],  # parallel residual
    "nemotron": [("input_layernorm", "self_attn.q_proj"),  # LayerNorm of (1 + weight), biased
                 ("post_attention_layernorm", "mlp.up_proj")],
    "phi": [("input_layernorm", "self_attn.q_proj")],  # attention and MLP read one norm
    "olmo3": [],  # one rotary table per attention type
    "starcoder2": [("input_layernorm", "self_attn.q_proj"), ("post_attention_layernorm", "mlp.c_fc")],
}  # fmt: skip
assert not set(FOUND) & set(FAMILY_LAYOUT)


@pytest.fixture(scope="module", params=sorted(FOUND))
def tiny_other(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model: Path
) -> Path:
    family = request.param
    folder = tmp_path_factory.mktemp("other") / family
    return make_tiny(folder, default_model, model_type=family, kv_heads=3, pad_token_id=0)


def model_type(model: Path) -> str:
    return json.loads((model / "config.json").read_text())["model_type"]


def test_the_layout_found_pairs_the_norms_its_code_reads(tiny_other: Path) -> None:
    layout = open_checkpoint(tiny_other).layout
    assert layout.discovered
    pairs = [(norm, group[0]) for norm, group in layout.smooth]
    assert pairs == FOUND[model_type(tiny_other)]


def test_the_stream_computes_what_transformers_computes(tiny_other: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_other, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        expected = torch.log_softmax(hf(IDS).logits.float(), dim=-1)
    got = torch.stack(evaluator_log_probs(open_checkpoint(tiny_other), IDS.tolist()))
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_checkpoints_reload_in_transformers(
    tmp_path: Path, tiny_other: Path, method: str
) -> None:
    out = tmp_path / method
    if method == "awq" and not FOUND[model_type(tiny_other)]:
        with pytest.raises(InputError, match="no norm/linear pairings"):
            llmq.quantize(tiny_other, out, scheme="w4a16", method=method, **FAST)
        return
    result = llmq.quantize(tiny_other, out, scheme="w4a16", method=method, **FAST)
    assert result.discovered_layout and "linears by shared input" in result.discovered_layout[0]
    assert all(layer.output_rel_rmse < layer.rtn_output_rel_rmse for layer in result.layers)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(
            theirs(IDS).logits, llmq.load_dequantized(out)(IDS).logits, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize(
    "model_type,fields,missing",
    [
        ("gpt2", {}, "no rotary position embeddings"),
        ("cohere", {}, "scales outside its layers (logit_scale)"),
        ("granite", {"embedding_multiplier": 12.0}, "embedding_multiplier"),
    ],
)
def test_what_cannot_be_found_is_refused_in_one_line(
    tmp_path: Path, default_model: Path, model_type: str, fields: dict, missing: str
) -> None:
    model = make_tiny(tmp_path / model_type, default_model, model_type=model_type, kv_heads=3,
                      pad_token_id=0, **fields)  # fmt: skip
    with pytest.raises(
        UnsupportedModelError, match=missing.replace("(", r"\(").replace(")", r"\)")
    ):
        open_checkpoint(model)
    result = CliRunner().invoke(
        app, ["quantize", str(model), "--out", str(tmp_path / "out"), "--no-model-free"]
    )
    assert_bad_input(result, missing)
