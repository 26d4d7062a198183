"""The command line: cheap help, exit codes CI can trust, one clear line for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from tests.conftest import assert_bad_input

runner = CliRunner()


@pytest.mark.process
def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\nimport llmq.cli.main as m\n"
        "try:\n    m.app(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"


def run(*args: str):
    return runner.invoke(app, list(args))


def test_paths_with_brackets_are_printed_as_given(tmp_path: Path) -> None:
    """Rich markup read `[red]` in a path as a style and dropped it from the error line."""
    folder = tmp_path / "run[red]"
    folder.mkdir()
    (folder / "bad[x].safetensors").write_bytes(b"garbage")
    assert_bad_input(run("fallback-scan", str(tmp_path)), "run[red]/bad[x].safetensors: truncated")
    assert_bad_input(
        run("quantize", str(folder / "m[old]"), "--out", str(tmp_path / "o")), "m[old]"
    )


@pytest.mark.parametrize(
    ("command", "fragment"),
    [("calibrate", "[in, in] float32"), ("fallback-scan", "E[xⱼ²]")],
)
def test_help_shows_bracketed_text(command: str, fragment: str) -> None:
    """Rich markup read `[x²]` and `[in, in]` as style tags and dropped them from --help."""
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0 and fragment in " ".join(result.output.split())  # as wrapped


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--group-size", "100"], "power of two"),
        (["--scheme", "w5a16"], "unknown scheme"),
        (["--num-samples", "0"], "--num-samples 0"),
        (["--method", "magic"], "unknown method"),
        (["--clip", "maybe"], "clip"),
        (["--method", "gptq", "--dampening-frac", "2"], "dampening_frac"),
        (["--method", "gptq", "--actorder", "group"], "weight_g_idx"),
        (["--method", "gptq", "--skip-layer-check"], "needs calibration"),
        (["--scheme", "fp8", "--group-size", "64"], "the format fixes the group size"),
        (["--scheme", "fp8-block", "--group-size", "64"], "the format fixes the group size"),
        (["--scheme", "w8a8", "--smooth", "1.5"], "alpha must be in [0, 1]"),
        (["--scheme", "w8a8", "--smooth", "strong"], "expected alpha"),
        (["--smooth", "0.5"], "SmoothQuant is for schemes that quantize them"),
        (["--scheme", "w8a8", "--method", "awq", "--smooth", "0.5"], "folds its own scales"),
        (["--kv-cache", "int4"], "--kv-cache int4: Input should be 'fp8', 'int8' or 'none'"),
        (["--activations", "static"], "does not quantize activations"),
        (["--scheme", "fp8-block", "--activations", "static"], "per-token-group"),
        (["--scheme", "w8a8", "--observer", "mse"], "observers choose static scales"),
        (["--scheme", "w8a8", "--activations", "sometimes"], "activations"),
        (["--scheme", "w8a8", "--smooth", "0.5", "--skip-layer-check"], "need calibration"),
        (["--scheme", "fp8-block", "--clip", "mse"], "block-scaled"),
        (["--resume-every", "-1"], "--resume-every -1.0: must be >= 0"),
        (["--stage-activations", "host"], "--stage-activations host: not a setting"),
        (["--ignore", "re:("], "invalid regular expression"),
        # a typo, and a regex without the leading `.*` (`re:` matches from the name's start)
        (["--ignore", "down_porj"], "--ignore 'down_porj': matches none of this model's"),
        (["--ignore", r"re:layers\.0\."], "matches none of this model's"),
    ],
)
def test_bad_options_exit_2(
    tmp_path: Path, tiny_llama: Path, extra: list[str], fragment: str
) -> None:
    result = run("quantize", str(tiny_llama), "--out", str(tmp_path / "out"), *extra)
    assert_bad_input(result, fragment)
    assert not (tmp_path / "out").exists()


def test_bad_paths_exit_2(tmp_path: Path, tiny_llama: Path) -> None:
    assert_bad_input(
        run("quantize", str(tmp_path / "missing"), "--out", str(tmp_path / "o")), "no such folder"
    )
    assert_bad_input(run("quantize", str(tmp_path), "--out", str(tmp_path / "o")), "no config.json")
    (tmp_path / "exists").mkdir()
    assert_bad_input(
        run("quantize", str(tiny_llama), "--out", str(tmp_path / "exists")), "already exists"
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = run(
        "quantize", str(tiny_llama), "--out", str(tmp_path / "o"), "--calib-text", str(empty)
    )
    assert_bad_input(result, "empty")
    result = run(
        "quantize", str(tiny_llama), "--out", str(tmp_path / "o"), "--calib-text", "nope.jsonl"
    )
    assert_bad_input(result, "no such file")
    assert not (tmp_path / "o").exists()


def test_quantize_json_and_eval_gate(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "q"
    result = run("quantize", str(tiny_llama), "--out", str(out), "--scheme", "w8a8",
                 "--num-samples", "1", "--seq-len", "32", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["scheme"] == "W8A8" and len(data["layers"]) == 2
    gate = [
        "eval",
        str(out),
        "--baseline",
        str(tiny_llama),
        "--eval-windows",
        "2",
        "--seq-len",
        "64",
    ]
    failed = run(*gate, "--max-ppl-increase", "0%", "--json")
    assert failed.exit_code == 1, failed.output
    report = json.loads(failed.stdout)[0]
    assert report["passed"] is False and report["increase"] > 0
    assert "A int8 token" in report["model"]["quantized"]
    passed = run(*gate, "--max-ppl-increase", "1000%")
    assert passed.exit_code == 0, passed.output
    assert "PASS" in passed.stdout and "BOS no" in passed.stdout
    assert_bad_input(run(*gate, "--max-ppl-increase", "lots"), "expected a percentage")


def test_models_lists_the_default(default_model: Path) -> None:
    result = run("models", "--json")
    assert result.exit_code == 0
    assert {"name": "smollm2-135m", "cached": True}.items() <= json.loads(result.stdout)[0].items()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
def test_asking_for_an_absent_gpu_is_bad_input(tmp_path: Path, tiny_llama: Path) -> None:
    result = run("quantize", str(tiny_llama), "--out", str(tmp_path / "o"), "--device", "cuda")
    assert_bad_input(result, "no CUDA GPU")
    assert not (tmp_path / "o").exists()


def test_eval_of_a_static_checkpoint_missing_its_input_scale_exits_2(
    tmp_path: Path, tiny_llama: Path
) -> None:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "static"
    llmq.quantize(tiny_llama, out, scheme="fp8", activations="static", num_samples=2, seq_len=64)
    shard = out / "model-00002-of-00003.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.0.self_attn.q_proj.input_scale"]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["model.layers.0.self_attn.q_proj.input_scale"]
    index_file.write_text(json.dumps(index))
    result = run("eval", str(out), "--eval-windows", "1", "--seq-len", "32")
    assert_bad_input(result, "q_proj.input_scale is missing")
