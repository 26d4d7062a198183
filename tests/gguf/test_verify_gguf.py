"""`llmq verify FILE.gguf`: transformers' GGUF reader is held to the model the file's tensors
define on its source's architecture; a file whose metadata misstates the model fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.gguf import model as gguf_model
from tests.conftest import assert_bad_input, make_tiny, sharpen


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """A tiny Llama with 256-wide rows (whole K-quant super-blocks) and peaked distributions, so
    that a wrong hyperparameter moves the log-probabilities well past the tolerance."""
    folder = make_tiny(tmp_path_factory.mktemp("verify-gguf") / "llama", default_model, hidden=256, heads=4, kv_heads=2)  # fmt: skip
    return sharpen(folder)


def verified(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["verify", *args, "--json"])
    return result.exit_code, json.loads(result.stdout) if result.exit_code in (0, 1) else {}


@pytest.mark.integration
def test_a_file_llmq_wrote_passes_against_the_source_it_records(
    tmp_path: Path, source: Path
) -> None:
    out = tmp_path / "model.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q4_k_m", imatrix="none")
    code, report = verified(str(out), "--baseline", str(source))
    assert code == 0 and report["passed"]
    [loader] = report["loaders"]
    assert loader["loader"] == "transformers" and loader["status"] == "ok"
    assert str(source) in report["reference"]
    assert (
        report["against"]["max_abs"] > loader["comparison"]["distance"]["max_abs"]
    )  # 4 bits moved it


@pytest.mark.integration
def test_metadata_that_misstates_the_model_fails_with_wrong_logits(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rotary base written 100x too small: the tensors are right, the model is not."""
    real = gguf_model._rope_theta
    monkeypatch.setattr(gguf_model, "_rope_theta", lambda config: real(config) / 100)
    out = tmp_path / "wrong-rope.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    code, report = verified(str(out))
    assert code == 1 and not report["passed"]
    [loader] = report["loaders"]
    assert loader["status"] == "wrong logits"


def test_what_verify_cannot_hold_a_gguf_file_to_is_one_line(tmp_path: Path, source: Path) -> None:
    out = tmp_path / "model.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    runner = CliRunner()
    assert_bad_input(runner.invoke(app, ["verify", str(out), "--loader", "llmq"]), "--loader llmq: a GGUF file is verified with transformers")  # fmt: skip
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model")
    assert_bad_input(runner.invoke(app, ["verify", str(not_gguf)]), "not a folder or a GGUF file")
    other = tmp_path / "other"
    other.mkdir()
    make_tiny(other / "llama", source, hidden=192)
    assert_bad_input(runner.invoke(app, ["verify", str(out), "--baseline", str(other / "llama")]), "token_embd.weight is [49152, 256], model.embed_tokens.weight")  # fmt: skip
