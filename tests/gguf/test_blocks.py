"""GGUF block encoders against gguf's reference dequantizer (bit-exact bytes) and quantizers
(error), with per-weight error bounds and SQNR floors, and the grid search against the plain
absmax grid on importance-weighted error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmq.gguf import SPECS, block_spec, choose_grid, codes_for, dequantized, pack, quantize

TYPES = [q.name for q in SPECS]
# gguf ships reference quantizers for these (not for the K-quants)
REFERENCE_QUANTIZERS = ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1"]
# dB on N(0, 0.02) weights, about 0.5 dB under what the encoders reach; roughly 6 dB per bit
SQNR_FLOOR = {
    "Q8_0": 45.0,
    "Q4_0": 21.0,
    "Q5_0": 27.0,
    "Q4_1": 22.5,
    "Q5_1": 28.5,
    "Q4_K": 22.5,
    "Q5_K": 28.5,
    "Q6_K": 35.0,
}


def awkward_weights(rows: int = 24, cols: int = 512, seed: int = 0) -> np.ndarray:
    """Normal weights with rows at scales 1e-4 to 30, an all-zero block, a constant block, an
    all-positive block, an outlier and a row holding one non-zero weight."""
    rng = np.random.default_rng(seed)
    scales = np.geomspace(1e-4, 30.0, rows).astype(np.float32)
    w = rng.normal(0, 1, (rows, cols)).astype(np.float32) * scales[:, None]
    w[1, :256] = 0.0
    w[2, :256] = 0.37
    w[3, 256:] = np.abs(w[3, 256:])
    w[4, 10] = 100 * scales[4]
    w[5] = 0.0
    w[5, 300] = -0.5
    return w


def sqnr(w: np.ndarray, deq: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(w.astype(np.float64) ** 2) / np.sum((w - deq) ** 2.0)))


def weighted_error(w: np.ndarray, deq: np.ndarray, importance: np.ndarray) -> float:
    return float(np.sum(importance * (w.astype(np.float64) - deq) ** 2))


def encode(qtype: str, w: np.ndarray, importance=None, search=True):
    grid = choose_grid(qtype, w, importance, search=search)
    codes = codes_for(grid, w)
    return grid, codes, dequantized(grid, codes)


@pytest.mark.parametrize("search", [True, False], ids=["search", "absmax"])
@pytest.mark.parametrize("qtype", TYPES)
def test_packed_bytes_decode_to_our_values_bit_for_bit(qtype: str, search: bool) -> None:
    w = awkward_weights()
    grid, codes, ours = encode(qtype, w, search=search)
    data = pack(grid, codes)
    gtype = GGMLQuantizationType[qtype]
    assert data.dtype == np.uint8
    assert data.shape == gguf.quant_shape_to_byte_shape(w.shape, gtype)
    theirs = gguf.quants.dequantize(data, gtype)
    assert theirs.shape == w.shape
    assert np.array_equal(ours, theirs)
    if search:  # quantize is this, in one call
        assert np.array_equal(quantize(qtype, w), data)


@pytest.mark.parametrize("qtype", TYPES)
def test_error_is_half_a_step_inside_the_grid_and_the_distance_outside(qtype: str) -> None:
    """Inside [lowest, highest] grid value a weight is off by at most half its group's step;
    outside, by its distance to the nearest end (clamping is the only other error)."""
    spec = block_spec(qtype)
    w = awkward_weights(seed=1)
    grid, codes, deq = encode(qtype, w)
    size = spec.group_size
    step = np.repeat(grid.step, size, axis=1).astype(np.float64)
    offset = np.repeat(grid.offset, size, axis=1).astype(np.float64)
    ends = np.stack([step * spec.code_min - offset, step * spec.code_max - offset])
    low, high = ends.min(0), ends.max(0)
    err = np.abs(w - deq.astype(np.float64))
    slack = 1e-6 * np.abs(w) + 1e-7 * np.abs(step) + 1e-12
    inside = (w >= low) & (w <= high)
    assert np.all(err[inside] <= np.abs(step[inside]) / 2 + slack[inside])
    outside = np.maximum(low - w, w - high)
    assert np.all(err[~inside] <= outside[~inside] + slack[~inside])
    # and the codes of the decoded values are the codes (groups with a zero step have one value)
    live = np.repeat(grid.step != 0, size, axis=1)
    assert np.array_equal(codes_for(grid, deq)[live], codes[live])


@pytest.mark.parametrize("qtype", TYPES)
def test_sqnr_floor_and_exact_zeros(qtype: str) -> None:
    w = np.random.default_rng(2).normal(0, 0.02, (64, 1024)).astype(np.float32)
    w[7] = 0.0
    _, codes, deq = encode(qtype, w)
    assert sqnr(w, deq) > SQNR_FLOOR[qtype]
    assert not deq[7].any()
    spec = block_spec(qtype)
    assert codes.min() >= spec.code_min and codes.max() <= spec.code_max


@pytest.mark.parametrize("qtype", TYPES)
def test_search_and_importance_lower_the_weighted_error(qtype: str) -> None:
    """With skewed column importance (log-normal, a 1000x spread) the searched grid beats the
    absmax grid, and passing the importance beats searching without it."""
    rng = np.random.default_rng(3)
    cols = 1024
    w = (rng.standard_t(5, (64, cols)) * 0.02).astype(np.float32)
    importance = np.exp(rng.normal(0, 1.5, cols)).astype(np.float32)
    absmax = weighted_error(w, encode(qtype, w, importance, search=False)[2], importance)
    unweighted = weighted_error(w, encode(qtype, w)[2], importance)
    weighted = weighted_error(w, encode(qtype, w, importance)[2], importance)
    assert weighted < 0.9 * absmax
    assert weighted < 0.95 * unweighted
    # without importance the search still beats absmax on plain squared error
    ones = np.ones(cols, dtype=np.float32)
    plain_absmax = weighted_error(w, encode(qtype, w, search=False)[2], ones)
    assert weighted_error(w, encode(qtype, w)[2], ones) < 0.97 * plain_absmax


@pytest.mark.parametrize("qtype", REFERENCE_QUANTIZERS)
def test_error_no_worse_than_gguf_reference_quantizer(qtype: str) -> None:
    gtype = GGMLQuantizationType[qtype]
    for w in (awkward_weights(seed=4), np.random.default_rng(5).normal(0, 0.02, (32, 1024))):
        w = w.astype(np.float32)
        ours = gguf.quants.dequantize(quantize(qtype, w), gtype)
        reference = gguf.quants.dequantize(gguf.quants.quantize(w, gtype), gtype)
        assert np.sum((w - ours) ** 2.0) <= np.sum((w - reference) ** 2.0)


def test_zero_importance_group_still_gets_a_grid() -> None:
    w = np.random.default_rng(6).normal(0, 0.02, (8, 256)).astype(np.float32)
    importance = np.ones(256, dtype=np.float32)
    importance[:32] = 0.0
    for qtype in ("Q4_K", "Q4_0"):
        _, _, deq = encode(qtype, w, importance)
        assert sqnr(w[:, :32], deq[:, :32]) > 15


def test_types_by_name_or_enum() -> None:
    w = awkward_weights(rows=8, cols=512)
    by_name = quantize("q4_k", w)
    assert np.array_equal(by_name, quantize(GGMLQuantizationType.Q4_K, w))
    assert by_name.shape == (8, 2 * GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][1])


@pytest.mark.parametrize(
    ("qtype", "cols", "fragment"),
    [
        ("Q4_K", 288, "multiple of its block size 256, got 288"),
        ("Q4_0", 48, "multiple of its block size 32, got 48"),
        ("Q3_K", 256, "unsupported GGUF type 'Q3_K'"),
        ("nope", 256, "unsupported GGUF type 'nope'"),
        (GGMLQuantizationType.IQ2_XXS, 256, "unsupported GGUF type"),
    ],
)
def test_bad_type_or_shape_is_refused(qtype, cols: int, fragment: str) -> None:
    w = np.zeros((2, cols), dtype=np.float32)
    with pytest.raises(ValueError, match=r"choose one of|keep such a tensor") as info:
        quantize(qtype, w)
    assert fragment in str(info.value)


def test_bad_weights_importance_and_codes_are_refused() -> None:
    w = np.ones((2, 256), dtype=np.float32)
    with pytest.raises(ValueError, match="2-D"):
        choose_grid("Q8_0", w[0])
    with pytest.raises(ValueError, match="NaN or Inf"):
        choose_grid("Q8_0", np.where(w > 0, np.nan, w))
    with pytest.raises(ValueError, match=r"importance must have shape \(256,\)"):
        choose_grid("Q8_0", w, np.ones(128, dtype=np.float32))
    with pytest.raises(ValueError, match="finite and >= 0"):
        choose_grid("Q8_0", w, -np.ones(256, dtype=np.float32))
    with pytest.raises(ValueError, match="overflow"):
        choose_grid("Q4_0", w * 1e9)
    grid = choose_grid("Q4_0", w)
    with pytest.raises(ValueError, match=r"codes must lie in \[-8, 7\]"):
        pack(grid, np.full(w.shape, 8))
    with pytest.raises(ValueError, match="grid is for"):
        codes_for(grid, np.ones((3, 256), dtype=np.float32))
