"""What a scan finds to read, from the headers of hand-built safetensors folders: filters that
leave nothing, corrupt, unreadable and absent files, nothing to scan at all, and the order in
which tensors are listed."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.errors import InputError
from tests.conftest import assert_bad_input
from tests.fallback.conftest import gaussian

runner = CliRunner()


@pytest.mark.parametrize(
    ("filters", "fragment"),
    [
        ({"include": "mpl"}, "--include 'mpl': none of the 6 tensors is left"),
        ({"include": "mlp", "exclude": "weight"}, "--include 'mlp' --exclude 'weight': none"),
    ],
)
def test_filters_that_leave_nothing_are_bad_input(
    checkpoint: Path, filters: dict, fragment: str
) -> None:
    """A typo in --include must not turn a --fail-on-flagged gate into a scan of nothing."""
    with pytest.raises(InputError, match=re.escape(fragment)):
        llmq.fallback_scan(checkpoint, **filters)
    only_packed = llmq.fallback_scan(checkpoint, include="weight_packed")  # matched, then skipped
    assert not only_packed.tensors and len(only_packed.skipped) == 1
    shown = runner.invoke(app, ["fallback-scan", str(checkpoint), "--include", "weight_packed"])
    assert shown.exit_code == 0 and "skipped 1 tensor: integer tensor" in shown.output
    assert "per layer type" not in shown.output  # no empty tables
    result = runner.invoke(app, ["fallback-scan", str(checkpoint), "--include", "mpl", "--fail-on-flagged"])  # fmt: skip
    assert_bad_input(result, "none of the 6 tensors is left to scan")


def test_corrupt_files_are_reported_and_the_rest_scanned(checkpoint: Path, tmp_path: Path) -> None:
    good = (checkpoint / "extra" / "head.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + header_len])
    data = good[8 + header_len :]
    broken = {
        "truncated.safetensors": good[: len(good) // 2],
        "huge-header.safetensors": struct.pack("<Q", 10**9) + good[8:],
        "not-json.safetensors": good[:8] + b"{" * header_len + data,
        "offsets.safetensors": _with_header(header, "lm_head.weight", [0, 10**9]) + data,
        "tiny.safetensors": b"\x01",
    }
    for name, data in broken.items():
        (checkpoint / name).write_bytes(data)
    (checkpoint / "dangling.safetensors").symlink_to(tmp_path / "blob-never-downloaded")
    (checkpoint / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00003-of-00003.safetensors"}})
    )
    (checkpoint / "extra" / "model.safetensors.index.json").write_text("[1, 2]")
    report = llmq.fallback_scan(checkpoint)
    assert set(report.failed) == {
        *broken, "dangling.safetensors", "model-00003-of-00003.safetensors",
        str(Path("extra") / "model.safetensors.index.json"),
    }  # fmt: skip
    assert report.failed["dangling.safetensors"] == f"a broken symbolic link to {tmp_path / 'blob-never-downloaded'}"  # fmt: skip
    assert "exceeds file size" in report.failed["huge-header.safetensors"]
    assert "not valid JSON" in report.failed["not-json.safetensors"]
    assert "outside the" in report.failed["offsets.safetensors"]
    assert len(report.tensors) == 5  # the good files are all scanned


def _with_header(header: dict, name: str, offsets: list[int]) -> bytes:
    raw = json.dumps({**header, name: {**header[name], "data_offsets": offsets}}).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_file_is_reported(checkpoint: Path) -> None:
    locked = checkpoint / "extra" / "head.safetensors"
    locked.chmod(0)
    try:
        report = llmq.fallback_scan(checkpoint)
    finally:
        locked.chmod(0o644)
    assert "cannot read" in report.failed[str(Path("extra") / "head.safetensors")]


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: p / "missing", "no such file or folder"),
        (lambda p: p, "no .safetensors files"),
        (lambda p: p / "notes.txt", "not a .safetensors"),
    ],
)
def test_nothing_to_scan_is_bad_input(tmp_path: Path, make, fragment: str) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(InputError, match=fragment):
        llmq.fallback_scan(make(tmp_path))


def test_tensors_are_listed_with_layer_numbers_in_numeric_order(tmp_path: Path) -> None:
    layers = [10, 2, 1, 0, 11]
    weights = {f"model.layers.{i}.mlp.up_proj.weight": gaussian(8, 64, i) for i in layers}
    packed = {f"model.layers.{i}.mlp.up_proj.weight_packed": torch.zeros(8, 8, dtype=torch.int32) for i in layers}  # fmt: skip
    save_file({**weights, **packed}, str(tmp_path / "m.safetensors"))
    report = llmq.fallback_scan(tmp_path, workers=2)
    order = [f"model.layers.{i}.mlp.up_proj" for i in sorted(layers)]
    assert [t.name for t in report.tensors] == [f"{name}.weight" for name in order]
    assert [s.name for s in report.skipped] == [f"{name}.weight_packed" for name in order]
