"""What the GGUF family tests share: a SentencePiece tokenizer like Gemma's, tiny models of each
family, the llama.cpp marker, and `llmq verify` as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

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


def tiny_gpt_oss(folder: Path, tokenizer: Path) -> Path:
    """GPT-OSS with its release's YaRN, 256-wide rows; untied, as llama.cpp's gpt-oss reads
    its own output."""
    return make_tiny_gpt_oss(folder, tokenizer, hidden=256, heads=4, kv_heads=2, tied=False, intermediate_size=256)  # fmt: skip
