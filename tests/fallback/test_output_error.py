"""Calibration statistics: linears scored by their share of the estimated output error, in the
scan and in `quantize --fallback auto`."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmq


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
