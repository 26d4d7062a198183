"""The scan over folders of hand-built safetensors: what is flagged and why, the CLI's exit codes
and report files, and the path scan -> report -> quantize --fallback -> reload."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.fallback.report import ScanReport, tensor_kind
from tests.conftest import assert_bad_input
from tests.fallback.conftest import gaussian, with_outlier

runner = CliRunner()


def test_scan_flags_the_outlier_not_the_gaussians(checkpoint: Path) -> None:
    report = llmq.fallback_scan(checkpoint, workers=2)
    names = {t.name: t for t in report.tensors}
    assert set(names) == {
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight",
        "lm_head.weight",
    }  # fmt: skip
    assert [t.name for t in report.flagged] == ["model.layers.0.mlp.down_proj.weight"]
    outlier = names["model.layers.0.mlp.down_proj.weight"]
    assert (
        outlier.stats.nrmse > 0.1 and outlier.stats.spread_ratio > 60 and len(outlier.reasons) == 2
    )
    assert names["model.layers.0.self_attn.q_proj.weight"].stats.nrmse < 0.02
    assert names["lm_head.weight"].file == str(Path("extra") / "head.safetensors")
    assert names["model.layers.1.mlp.up_proj.weight"].dtype == "F8_E4M3"
    (skipped,) = report.skipped
    assert skipped.name.endswith("weight_packed") and "integer tensor (I32)" in skipped.reason
    assert report.failed == {}


def test_include_exclude_and_nrmse_metric_choice(checkpoint: Path) -> None:
    report = llmq.fallback_scan(checkpoint, include=r"layers\.0\.", exclude="norm", scheme="w4a16")
    assert {t.kind for t in report.tensors} == {"q", "down"}
    assert report.args.num_bits == 4 and report.nrmse_threshold == 0.2


def test_nan_and_inf_tensors_are_flagged_not_fatal(tmp_path: Path) -> None:
    w = gaussian(16, 64, 0, torch.float32)
    w[0, 0], w[0, 1] = math.nan, math.inf
    save_file({"model.layers.0.mlp.up_proj.weight": w}, str(tmp_path / "m.safetensors"))
    (scan,) = llmq.fallback_scan(tmp_path).tensors
    assert (scan.stats.nan, scan.stats.inf, scan.stats.nrmse) == (1, 1, None)
    assert scan.flagged and "1 NaN, 1 Inf" in scan.reasons[0]


def test_layer_kinds() -> None:
    assert [tensor_kind(n) for n in (
        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.3.mlp.experts",
    )] == ["q", "down", "embed", "lm_head", "norm", "other"]  # fmt: skip


# --- CLI --------------------------------------------------------------------------------------


def test_cli_reports_and_exit_codes(checkpoint: Path, tmp_path: Path) -> None:
    files = {"--report": tmp_path / "scan.json", "--csv": tmp_path / "scan.csv",
             "--markdown": tmp_path / "scan.md", "--plot": tmp_path / "scan.png"}  # fmt: skip
    options = [part for option, path in files.items() for part in (option, str(path))]
    clean = runner.invoke(app, ["fallback-scan", str(checkpoint), *options])
    assert clean.exit_code == 0, clean.output
    assert "model.layers.0.mlp.down_proj.weight" in clean.output
    assert "skipped 1 tensor: integer tensor (I32)" in clean.output  # one packed tensor, singular
    data = json.loads(files["--report"].read_text())
    assert (data["schema"], data["version"]) == ("llmq.fallback-scan", 1)
    assert data["flagged"] == ["model.layers.0.mlp.down_proj.weight"]
    assert files["--csv"].read_text().splitlines()[1].startswith("model.layers.0.mlp.down_proj.weight,")  # fmt: skip
    assert "| down | 1 | 1 |" in files["--markdown"].read_text()
    assert files["--plot"].read_bytes()[:4] == b"\x89PNG"
    gate = runner.invoke(app, ["fallback-scan", str(checkpoint), "--fail-on-flagged", "--json"])
    assert gate.exit_code == 1
    assert json.loads(gate.stdout)["flagged"] == data["flagged"]
    strict = runner.invoke(app, ["fallback-scan", str(checkpoint), "--fail-on-flagged", "--nrmse-threshold", "0.5", "--ratio-threshold", "inf"])  # fmt: skip
    assert strict.exit_code == 0, strict.output
    (checkpoint / "bad.safetensors").write_bytes(b"\x00" * 4)
    failed = runner.invoke(app, ["fallback-scan", str(checkpoint), "--json"])
    assert failed.exit_code == 2 and "error: bad.safetensors: truncated" in failed.stderr
    assert len(json.loads(failed.stdout)["tensors"]) == 5


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--jobs", "0"], "--jobs 0: must be between 1 and 256"),
        (["--scheme", "int3"], "unknown scheme 'int3'"),
        (["--nrmse-threshold", "-1"], "--nrmse-threshold -1"),
        (["--include", "("], "invalid regular expression"),
        (["--plot", "scan.jpg"], "expected a .png file"),
        (["--sample", "0"], "--sample 0"),
    ],
)
def test_cli_bad_options(checkpoint: Path, extra: list[str], fragment: str) -> None:
    assert_bad_input(runner.invoke(app, ["fallback-scan", str(checkpoint), *extra]), fragment)


# --- scan -> report -> quantize --fallback -> reload ------------------------------------------


def test_quantize_keeps_flagged_linears_and_reloads(model_with_outlier, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder, target = model_with_outlier
    report_file = tmp_path / "scan.json"
    scan = runner.invoke(app, ["fallback-scan", str(folder), "--nrmse-threshold", "0.1", "--report", str(report_file)])  # fmt: skip
    assert scan.exit_code == 0, scan.output
    assert ScanReport.load(report_file).flagged_modules() == [target]
    out = tmp_path / "q"
    result = runner.invoke(app, ["quantize", str(folder), "-o", str(out), "--fallback", str(report_file), "--skip-layer-check"])  # fmt: skip
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == sorted(["lm_head", target])
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = load_file(str(folder / "model.safetensors"))
    kept = reloaded.get_submodule(target)
    assert torch.equal(kept.weight, original[f"{target}.weight"])
    quantized = reloaded.get_submodule("model.layers.1.self_attn.q_proj")
    assert hasattr(quantized, "weight_packed") and not hasattr(kept, "weight_packed")
    with torch.no_grad():
        assert reloaded(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
    auto = llmq.quantize(folder, tmp_path / "auto", scheme="w8a16", fallback="auto", skip_layer_check=True)  # fmt: skip
    assert auto.fallback["report"] == "auto" and auto.fallback["scheme"] == "int8 channel"
    assert auto.fallback["kept"] == [target]  # 40.0 in one row: that row's int8 steps are 0.3
    assert "NRMSE > 0.05" in auto.fallback["rule"]  # int8's default
    tuned = llmq.quantize(folder, tmp_path / "tuned", scheme="w8a16", fallback="auto", fallback_threshold=0.5, skip_layer_check=True)  # fmt: skip
    assert "NRMSE > 0.5" in tuned.fallback["rule"]


def test_quantize_refuses_a_report_of_another_checkpoint(
    model_with_outlier, tmp_path: Path
) -> None:
    folder, _ = model_with_outlier
    other = tmp_path / "other"
    other.mkdir()
    save_file({"model.layers.7.mlp.down_proj.weight": with_outlier(64, 64, 0)}, str(other / "m.safetensors"))  # fmt: skip
    report_file = tmp_path / "other.json"
    runner.invoke(app, ["fallback-scan", str(other), "--report", str(report_file)])
    result = runner.invoke(app, ["quantize", str(folder), "-o", str(tmp_path / "q"), "--fallback", str(report_file), "--skip-layer-check"])  # fmt: skip
    assert result.exit_code == 2 and "does not have" in result.output
    misused = runner.invoke(app, ["quantize", str(folder), "-o", str(tmp_path / "q"), "--fallback", str(report_file), "--fallback-threshold", "0.1"])  # fmt: skip
    assert misused.exit_code == 2 and "use --fallback auto" in misused.output
    (tmp_path / "junk.json").write_text("{}")
    junk = runner.invoke(app, ["quantize", str(folder), "-o", str(tmp_path / "q"), "--fallback", str(tmp_path / "junk.json"), "--skip-layer-check"])  # fmt: skip
    assert junk.exit_code == 2 and "not a fallback-scan report" in junk.output
    assert not (tmp_path / "q").exists()
