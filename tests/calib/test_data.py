"""Calibration and evaluation text: reproducible, disjoint, and readable from files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llmq.calib.data import calibration_windows, evaluation_windows, load_documents
from llmq.errors import InputError
from llmq.texts import BUILTIN_TEXTS, builtin_documents


@pytest.fixture(scope="module")
def tokenizer(default_model: Path):
    return AutoTokenizer.from_pretrained(default_model)


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
    stream = tokenizer("\n\n".join(builtin_documents("news", "heldout")), add_special_tokens=False)
    assert windows.input_ids.flatten().tolist() == stream["input_ids"][: 3 * 32]


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
