"""llama.cpp as `llmq verify`'s GGUF loader, run where its binaries are found ($LLMQ_LLAMA_CPP,
or the build benchmarks/peers/setup_llamacpp.sh makes): its saved log-probabilities match llmq's
evaluator on the file's tensors for every family, rope scaling and table type, and grow when the
file misstates the model; the saved-logits file is parsed as llama-perplexity writes it."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import llmq
from tests.gguf.families import (
    folder_name,
    needs_llama_cpp,
    spm_tokenizer,
    tiny,
    tiny_gpt_oss,
    verified,
)

__all__ = ["spm_tokenizer"]  # a fixture the tests take


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


def test_asking_for_llama_cpp_without_its_binaries_is_one_line(
    tmp_path: Path, default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--loader llama.cpp` where $LLMQ_LLAMA_CPP holds no llama-perplexity: exit 2, one line
    naming where it looked, the file unchanged."""
    from typer.testing import CliRunner

    from llmq.cli.main import app
    from tests.conftest import assert_bad_input

    source = tiny(tmp_path / "llama", default_model, "llama")
    out = tmp_path / "llama.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    before = out.read_bytes()
    monkeypatch.setenv("LLMQ_LLAMA_CPP", str(tmp_path / "nowhere"))
    result = CliRunner().invoke(app, ["verify", str(out), "--loader", "llama.cpp"])
    assert_bad_input(result, f"no llama-perplexity in {tmp_path / 'nowhere'}")
    assert out.read_bytes() == before
