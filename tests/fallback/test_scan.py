"""The scan over folders of hand-built safetensors: what is flagged, skipped and failed, the CLI's
exit codes and report files, and the path scan -> report -> quantize --fallback -> reload."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.errors import InputError
from llmq.fallback.report import ScanReport, tensor_kind
from tests.conftest import assert_bad_input, make_tiny

runner = CliRunner()


def gaussian(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def with_outlier(rows: int, cols: int, seed: int) -> torch.Tensor:
    w = gaussian(rows, cols, seed, torch.float32)
    w[1, 2] = 3.0  # 150 sigma: int8 per-tensor steps become 3.0/127, 1.2 sigma wide
    return w.to(torch.bfloat16)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """Two shards with an index, a nested folder, an outlier, fp8 and a packed int tensor."""
    root = tmp_path / "ckpt"
    (root / "extra").mkdir(parents=True)
    save_file(
        {
            "model.layers.0.self_attn.q_proj.weight": gaussian(128, 256, 0),
            "model.layers.0.mlp.down_proj.weight": with_outlier(256, 128, 1),
            "model.layers.0.input_layernorm.weight": torch.ones(256, dtype=torch.bfloat16),
        },
        str(root / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {
            "model.layers.1.mlp.up_proj.weight": gaussian(256, 128, 2).to(torch.float8_e4m3fn),
            "model.layers.1.mlp.up_proj.weight_packed": torch.zeros(256, 16, dtype=torch.int32),
        },
        str(root / "model-00002-of-00002.safetensors"),
    )
    save_file({"lm_head.weight": gaussian(64, 256, 3, torch.float32)}, str(root / "extra" / "head.safetensors"))  # fmt: skip
    index = {"weight_map": {"model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
                            "model.layers.1.mlp.up_proj.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


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


def test_workers_and_sampling(checkpoint: Path) -> None:
    one = llmq.fallback_scan(checkpoint, workers=1)
    two = llmq.fallback_scan(checkpoint, workers=2)
    for a, b in zip(one.tensors, two.tensors, strict=True):
        assert (a.name, a.reasons) == (b.name, b.reasons)
        x, y = a.stats, b.stats
        assert (x.q1, x.q3, x.min, x.max) == (y.q1, y.q3, y.min, y.max)
        # float32 sums split over a different number of threads: equal to rounding
        assert x.nrmse == pytest.approx(y.nrmse, rel=1e-6) and x.std == pytest.approx(y.std, rel=1e-6)  # fmt: skip
    sampled = llmq.fallback_scan(checkpoint, sample=1000)
    big = next(t for t in sampled.tensors if t.name.endswith("down_proj.weight"))
    assert big.sampled and big.stats.numel == 8 * 128  # whole rows, about 1000 values


def test_include_exclude_and_nrmse_metric_choice(checkpoint: Path) -> None:
    report = llmq.fallback_scan(checkpoint, include=r"layers\.0\.", exclude="norm", scheme="w4a16")
    assert {t.kind for t in report.tensors} == {"q", "down"}
    assert report.args.num_bits == 4 and report.nrmse_threshold == 0.2


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


def test_nan_and_inf_tensors_are_flagged_not_fatal(tmp_path: Path) -> None:
    w = gaussian(16, 64, 0, torch.float32)
    w[0, 0], w[0, 1] = math.nan, math.inf
    save_file({"model.layers.0.mlp.up_proj.weight": w}, str(tmp_path / "m.safetensors"))
    (scan,) = llmq.fallback_scan(tmp_path).tensors
    assert (scan.stats.nan, scan.stats.inf, scan.stats.nrmse) == (1, 1, None)
    assert scan.flagged and "1 NaN, 1 Inf" in scan.reasons[0]


def test_tensors_are_listed_with_layer_numbers_in_numeric_order(tmp_path: Path) -> None:
    layers = [10, 2, 1, 0, 11]
    weights = {f"model.layers.{i}.mlp.up_proj.weight": gaussian(8, 64, i) for i in layers}
    packed = {f"model.layers.{i}.mlp.up_proj.weight_packed": torch.zeros(8, 8, dtype=torch.int32) for i in layers}  # fmt: skip
    save_file({**weights, **packed}, str(tmp_path / "m.safetensors"))
    report = llmq.fallback_scan(tmp_path, workers=2)
    order = [f"model.layers.{i}.mlp.up_proj" for i in sorted(layers)]
    assert [t.name for t in report.tensors] == [f"{name}.weight" for name in order]
    assert [s.name for s in report.skipped] == [f"{name}.weight_packed" for name in order]


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
        (["--workers", "0"], "--workers 0"),
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


@pytest.fixture
def model_with_outlier(tmp_path: Path, default_model: Path) -> tuple[Path, str]:
    folder = make_tiny(tmp_path / "tiny", default_model)
    weights = load_file(str(folder / "model.safetensors"))
    target = "model.layers.1.self_attn.o_proj"
    weights[f"{target}.weight"][5, 7] = 40.0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, target


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


def test_calibration_statistics_score_linears_by_output_error_share(
    model_with_outlier, tmp_path: Path
) -> None:
    folder, target = model_with_outlier
    stats = tmp_path / "stats.safetensors"
    llmq.calibrate(folder, stats, num_samples=2, seq_len=32, hessian=True)
    plain = llmq.fallback_scan(folder)
    weighted = llmq.fallback_scan(folder, calib_stats=stats, ratio_threshold=None)
    assert weighted.calib_stats == str(stats) and plain.share_threshold is None
    shares = {t.name: t.error_share for t in weighted.tensors if t.error_share is not None}
    assert len(shares) == 14 and sum(shares.values()) == pytest.approx(1.0)  # 2 layers x 7
    assert max(shares, key=shares.get) == f"{target}.weight"
    assert weighted.by_score()[0].name == f"{target}.weight"
    assert [t.name for t in weighted.flagged] == [f"{target}.weight"]
    assert weighted.flagged[0].reasons[0].startswith("output error share")
    by_name = {t.name: t for t in weighted.tensors}
    assert by_name["model.norm.weight"].error_share is None  # judged by its NRMSE
    assert all(t.error_share is None and t.stats.weighted_nrmse is None for t in plain.tensors)
    auto = llmq.quantize(folder, tmp_path / "q", scheme="w8a16", fallback="auto", calib_stats=stats, fallback_threshold=0.5, skip_layer_check=True)  # fmt: skip
    assert "output error share > 0.5" in auto.fallback["rule"] and auto.fallback["kept"] == [target]


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
