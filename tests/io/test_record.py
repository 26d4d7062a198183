"""llmq.json, one typed record: written and read back whole, tolerant where a record only
informs, strict where `llmq verify` relies on it, and a later llmq's sections kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmq import __version__
from llmq.errors import InputError
from llmq.io.atomic import add_to_record, write_record
from llmq.io.record import RECORD_FILE, OutputRecord


def test_a_record_reads_back_as_written_sections_in_order(tmp_path: Path) -> None:
    record = OutputRecord(source_model="m", recipe={"scheme": "w4a16"}, files={"a": "1"})
    write_record(tmp_path, record)
    data = json.loads((tmp_path / RECORD_FILE).read_text())
    assert list(data) == ["llmq_version", "created", "source_model", "recipe", "files"]
    assert data["llmq_version"] == __version__
    assert OutputRecord.read(tmp_path) == record


def test_sections_of_a_later_llmq_survive_a_rewrite(tmp_path: Path) -> None:
    (tmp_path / RECORD_FILE).write_text(json.dumps({"llmq_version": "9.0", "gguf": {"type": "Q4_K"}}))  # fmt: skip
    add_to_record(tmp_path, distillation={"steps": 3})
    data = json.loads((tmp_path / RECORD_FILE).read_text())
    assert data == {"llmq_version": "9.0", "distillation": {"steps": 3}, "gguf": {"type": "Q4_K"}}


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", None])
def test_a_missing_or_damaged_record_reads_empty(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / RECORD_FILE).write_text(content)
    record = OutputRecord.read(tmp_path)
    assert record.to_dict() == {} and not record.written_by_llmq


def test_a_damaged_record_is_an_error_where_it_is_relied_on(tmp_path: Path) -> None:
    (tmp_path / RECORD_FILE).write_text("{not json")
    with pytest.raises(InputError, match=r"llmq\.json: unreadable"):
        OutputRecord.read(tmp_path, strict=True)
