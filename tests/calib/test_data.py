"""Calibration and evaluation text: reproducible, disjoint, and readable from files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmq.calib.data import calibration_windows, evaluation_windows, load_documents
from llmq.calib.tokenizer import load_tokenizer
from llmq.errors import InputError
from llmq.texts import BUILTIN_TEXTS, builtin_documents


@pytest.fixture(scope="module")
def tokenizer(default_model: Path):
    return load_tokenizer(default_model)


def test_sampling_is_reproducible_and_seeded(tokenizer) -> None:
    a = calibration_windows(tokenizer, "pydoc+news", num_samples=5, seq_len=64, seed=3)
    b = calibration_windows(tokenizer, "pydoc+news", num_samples=5, seq_len=64, seed=3)
    c = calibration_windows(tokenizer, "pydoc+news", num_samples=5, seq_len=64, seed=4)
    assert a.input_ids.shape == (5, 64)
    assert (a.input_ids == b.input_ids).all()
    assert not (a.input_ids == c.input_ids).all()


@pytest.mark.parametrize("name", list(BUILTIN_TEXTS))
def test_builtin_splits_are_disjoint(name: str) -> None:
    calibration = builtin_documents(name, "calibration")
    heldout = builtin_documents(name, "heldout")
    assert calibration and heldout
    assert not set(calibration) & set(heldout)
    # no held-out document occurs inside the calibration text either
    joined = "\n".join(calibration)
    assert not any(doc[:200] in joined for doc in heldout if len(doc) > 200)


def test_evaluation_windows_are_consecutive(tokenizer) -> None:
    windows = evaluation_windows(tokenizer, "news", seq_len=32, max_windows=3)
    text = "\n\n".join(builtin_documents("news", "heldout"))
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tokenizer.folder)(text, add_special_tokens=False)
    assert windows.input_ids.flatten().tolist() == reference["input_ids"][: 3 * 32]
    assert windows.add_bos is False


def test_files_load_through_datasets(tmp_path: Path) -> None:
    txt = tmp_path / "c.txt"
    txt.write_text("first line\nsecond line\n")
    assert load_documents(str(txt), "calibration") == ["first line\nsecond line"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ("alpha", "beta")))
    assert load_documents(str(jsonl), "calibration") == ["alpha", "beta"]
    import datasets

    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_dict({"text": ["gamma", "delta"]}).to_parquet(str(parquet))
    assert load_documents(str(parquet), "calibration") == ["gamma", "delta"]


def test_bad_calibration_sources(tmp_path: Path, tokenizer) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(InputError, match="empty"):
        load_documents(str(empty), "calibration")
    with pytest.raises(InputError, match="no such file"):
        load_documents(str(tmp_path / "missing.jsonl"), "calibration")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(InputError, match="fewer than"):
        calibration_windows(tokenizer, str(short), num_samples=1, seq_len=512, seed=0)


def test_tokenizers_that_add_bos_start_every_window_with_it(
    tmp_path: Path, default_model: Path
) -> None:
    """Gemma-style tokenizers put BOS first; perplexity windows must then start with it too."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    shutil.copy(default_model / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    backend = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.add_bos and tokenizer.bos_token_id == 1
    windows = evaluation_windows(tokenizer, "news", seq_len=16, max_windows=2)
    assert windows.add_bos and windows.input_ids[:, 0].tolist() == [1, 1]
    plain = evaluation_windows(load_tokenizer(default_model), "news", seq_len=16, max_windows=2)
    assert windows.input_ids[0, 1:].tolist() == plain.input_ids[0, :-1].tolist()


def test_a_corrupt_token_cache_entry_is_rebuilt(
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LLMQ_CACHE_DIR", str(tmp_path))
    fresh = evaluation_windows(tokenizer, "news", seq_len=64, max_windows=4).input_ids
    (entry,) = (tmp_path / "tokens").iterdir()
    entry.write_bytes(entry.read_bytes()[:-3])  # truncated: not a whole number of ids
    rebuilt = evaluation_windows(tokenizer, "news", seq_len=64, max_windows=4).input_ids
    assert torch.equal(rebuilt, fresh) and "unreadable cache entry" in caplog.text
    assert entry.stat().st_size % 4 == 0
