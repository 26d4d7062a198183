"""Calibration statistics: exact accumulators, a file that round-trips, reuse by quantize."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import llmq
from llmq.calib.stats import CalibStats, InputStats, add_gram
from llmq.errors import InputError


def test_accumulators_match_float64_reference() -> None:
    torch.manual_seed(0)
    batches = [torch.randn(3, 7, 16) for _ in range(4)]
    stats = InputStats.empty(16, hessian=True, device=torch.device("cpu"))
    for batch in batches:
        stats.update(batch)
    x = torch.cat([b.reshape(-1, 16) for b in batches]).double()
    torch.testing.assert_close(stats.absmax.double(), x.abs().amax(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(stats.mean_abs.double(), x.abs().mean(0), rtol=1e-5, atol=1e-7)
    assert stats.hessian is not None
    torch.testing.assert_close(
        stats.hessian.double(), 2 * x.T @ x / x.shape[0], rtol=1e-5, atol=1e-6
    )


def test_hessian_alone_skips_magnitudes_and_says_so() -> None:
    torch.manual_seed(0)
    batch = torch.randn(5, 16)
    full = InputStats.empty(16, hessian=True, device=torch.device("cpu"))
    alone = InputStats.empty(16, hessian=True, device=torch.device("cpu"), magnitudes=False)
    full.update(batch)
    alone.update(batch)
    assert alone.hessian is not None and full.hessian is not None
    assert torch.equal(alone.hessian, full.hessian)
    assert alone.absmax is None and alone.abs_sum is None
    with pytest.raises(ValueError, match="Hessian alone"):
        _ = alone.mean_abs
    rescaled = alone.rescaled(torch.full((16,), 2.0))
    assert rescaled.hessian is not None
    torch.testing.assert_close(rescaled.hessian, 4 * alone.hessian)


@pytest.mark.parametrize("width, leaf", [(150, 64), (128, 64), (40, 256), (577, 192), (7, 1)])
def test_gram_from_upper_blocks_matches_float64(width: int, leaf: int) -> None:
    torch.manual_seed(1)
    start = torch.randn(width, width)
    start = start @ start.T  # any symmetric running value
    rows = torch.randn(300, width)
    target = start.clone()
    add_gram(target, rows, beta=0.25, alpha=0.5, leaf=leaf)
    x = rows.double()
    expected = 0.25 * start.double() + 0.5 * x.T @ x
    torch.testing.assert_close(target.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(target, target.T)  # mirrored exactly, not computed twice


def test_calibrate_writes_reusable_stats(tmp_path: Path, tiny_llama: Path) -> None:
    path = tmp_path / "stats.safetensors"
    result = llmq.calibrate(tiny_llama, path, num_samples=2, seq_len=32, hessian=True)
    assert result.linears == 14
    stats = CalibStats.load(path)
    q, k = (
        stats.inputs["model.layers.0.self_attn.q_proj"],
        stats.inputs["model.layers.0.self_attn.k_proj"],
    )
    assert q is k  # shared input, stored once
    assert q.hessian is not None and q.hessian.shape == (192, 192)
    assert stats.metadata["seed"] == 0 and stats.metadata["tokens"] == 64
    out = llmq.quantize(
        tiny_llama, tmp_path / "q", scheme="w8a16", calib_stats=path, num_samples=1, seq_len=32
    )
    assert len(out.layers) == 2
    with pytest.raises(InputError, match="already exists"):
        llmq.calibrate(tiny_llama, path, num_samples=2, seq_len=32)


def test_foreign_or_corrupt_stats_are_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "x.safetensors"
    bogus.write_bytes(b"\x00" * 4)
    with pytest.raises(InputError, match="truncated"):
        CalibStats.load(bogus)
    with pytest.raises(InputError, match="no such statistics file"):
        CalibStats.load(tmp_path / "missing.safetensors")
