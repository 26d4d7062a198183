"""The compiled passes against numpy and torch references on the same values: float64 sums, sorts,
bincounts and the backbone's own quantizer (`quantize_grouped`, `scale_codes`)."""

from __future__ import annotations

import numpy
import pytest
import torch

from llmq.config import QuantArgs
from llmq.fallback import passes
from llmq.quant.primitives import choose_qparams, int_range, quantize_grouped, scale_codes

# around the passes' 4096-value blocks and their two interleaved histograms (odd lengths, and
# past the size from which the second histogram is used)
SIZES = [1, 2, 4095, 4096, 4097, 3 * 4096 + 1, 100_001, (1 << 19) + 3]


def gaussian(size: int, seed: int = 0) -> numpy.ndarray:
    values = numpy.random.default_rng(seed).standard_normal(size).astype(numpy.float32) * 0.02
    values[:: max(1, size // 5)] *= 40  # a few outliers
    return values


def upper_halves(values: numpy.ndarray) -> numpy.ndarray:
    return values.view(numpy.uint32) >> 16


@pytest.mark.parametrize("size", SIZES)
def test_summary_matches_numpy(size: int) -> None:
    values = gaussian(size, seed=size)
    counts = numpy.zeros(1 << 16, dtype=numpy.int64)
    low, high, total, squares, lower_used = passes.float32_summary(values, counts)
    as64 = values.astype(numpy.float64)
    assert (low, high) == (float(values.min()), float(values.max()))
    assert total == pytest.approx(float(as64.sum()), rel=1e-12, abs=1e-15)
    assert squares == pytest.approx(float((as64 * as64).sum()), rel=1e-12)
    assert lower_used == bool((values.view(numpy.uint32) & 0xFFFF).any())
    assert numpy.array_equal(counts, numpy.bincount(upper_halves(values), minlength=1 << 16))


def test_summary_adds_to_the_counts_and_orders_signed_zeros() -> None:
    values = numpy.array([-0.0, 0.0, -3.5, 2.25, -0.0], dtype=numpy.float32)
    counts = numpy.ones(1 << 16, dtype=numpy.int64)
    low, high, total, squares, lower_used = passes.float32_summary(values, counts)
    assert (low, high, total, squares, lower_used) == (-3.5, 2.25, -1.25, 17.3125, False)
    assert counts.sum() == (1 << 16) + values.size


def test_summary_sees_a_lower_half_set_only_at_the_end() -> None:
    values = numpy.full(3 * 4096 + 7, 0.5, dtype=numpy.float32)
    values[-1] = numpy.nextafter(numpy.float32(0.5), numpy.float32(1))
    counts = numpy.zeros(1 << 16, dtype=numpy.int64)
    assert passes.float32_summary(values, counts)[4] is True
    assert passes.float32_summary(values[:-1], counts)[4] is False


@pytest.mark.parametrize("bad", [numpy.nan, numpy.inf, -numpy.inf])
def test_summary_sum_of_squares_reveals_non_finite_values(bad: float) -> None:
    values = gaussian(5000)
    values[1234] = bad
    counts = numpy.zeros(1 << 16, dtype=numpy.int64)
    squares = passes.float32_summary(values, counts)[3]
    assert not numpy.isfinite(squares)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_refine_matches_quantize_rule_tails_and_members(size: int, symmetric: bool) -> None:
    values = gaussian(size, seed=size + 1)
    args = QuantArgs(num_bits=8, strategy="tensor", symmetric=symmetric)
    tensor = torch.from_numpy(values)
    scale, zero = choose_qparams(
        tensor.min().view(1), tensor.max().view(1), args, scale_dtype=torch.float32
    )
    grid = (float(scale), 0.0 if zero is None else float(zero), *map(float, int_range(8)))
    expected_error = _quantize_error(tensor, scale, zero, args)
    occupied = numpy.unique(upper_halves(values))
    buckets = occupied[:: max(1, occupied.size // 4)][:4].tolist()  # up to four, spread out
    expected_members = values[numpy.isin(upper_halves(values), buckets)]
    members = numpy.empty(expected_members.size, dtype=numpy.float32)
    low, high = -0.05, 0.03
    tail, error, found = passes.float32_refine(values, buckets, members, (low, high), grid)
    assert tail == int(((values < low) | (values > high)).sum())
    assert error == pytest.approx(expected_error, rel=1e-12, abs=1e-18)
    assert found == expected_members.size
    assert numpy.array_equal(members, expected_members)
    assert passes.float32_refine(values, buckets, members, (low, high), None)[1] == 0.0


def _quantize_error(
    values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: QuantArgs
) -> float:
    """Squared error of per-tensor quantization, by the backbone's own functions."""
    codes = quantize_grouped(values.view(1, 1, -1), scale.view(1, 1), zero, args).view(-1)
    return float((scale_codes(codes, scale, zero) - values).double().square().sum())


def test_refine_codes_are_quantizes_where_float32_quotients_tie() -> None:
    """`quantize` divides in float64. Values whose float32 quotient rounds onto a half while
    their float64 one does not: with the odd code below the tie, float32 alone would round
    them up (half to even), float64 rounds them down."""
    scale = numpy.float32(0.0123)
    ties = []
    for code in range(1, 120, 2):  # odd: half to even rounds k + 0.5 up
        middle = numpy.float32((code + 0.5) * numpy.float64(scale))
        for step in range(-40, 41):
            x = numpy.float32(middle + numpy.float32(step) * numpy.spacing(middle))
            if x / scale == numpy.float32(code + 0.5) and numpy.float64(x) / numpy.float64(scale) < code + 0.5:  # fmt: skip
                ties.append(x)
    assert len(ties) > 20  # the case is not rare near every half
    values = numpy.array(ties + [-v for v in ties] + [scale * 127], dtype=numpy.float32)
    args = QuantArgs(num_bits=8, strategy="tensor")
    tensor = torch.from_numpy(values)
    torch_scale = torch.tensor(float(scale), dtype=torch.float32)
    members = numpy.empty(values.size, dtype=numpy.float32)
    grid = (float(scale), 0.0, *map(float, int_range(8)))
    error = passes.float32_refine(values, [0], members, (-1.0, 1.0), grid)[1]
    assert error == pytest.approx(_quantize_error(tensor, torch_scale, None, args), rel=1e-12)
    float32_codes = numpy.rint(values / scale)  # what a float32 division alone would give
    float32_error = float(((float32_codes * scale - values).astype(numpy.float64) ** 2).sum())
    assert error != pytest.approx(float32_error, rel=1e-6)  # the test can tell the two apart


def test_refine_rounds_half_to_even_as_quantize_does() -> None:
    values = numpy.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.25], dtype=numpy.float32)
    members = numpy.empty(values.size, dtype=numpy.float32)
    error = passes.float32_refine(values, [0], members, (-1.0, 1.0), (1.0, 0.0, -127.0, 127.0))
    # half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0, -2.5 -> -2; 3.25 -> 3
    assert error[1] == pytest.approx(4 * 0.25 + 0.25 + 0.0625, abs=0)


@pytest.mark.parametrize("patterns_dtype", [numpy.uint16, numpy.uint8])
@pytest.mark.parametrize("size", [1, 4097, 100_001, (1 << 19) + 3])
def test_pattern_histogram_matches_bincount(patterns_dtype: type, size: int) -> None:
    bits = numpy.iinfo(patterns_dtype).bits
    patterns = numpy.random.default_rng(size).integers(0, 1 << bits, size).astype(patterns_dtype)
    counts = numpy.zeros(1 << bits, dtype=numpy.int64)
    passes.pattern_histogram(patterns, counts)
    assert numpy.array_equal(counts, numpy.bincount(patterns, minlength=1 << bits))


def test_patterns_at_ranks_match_a_sort() -> None:
    g = torch.Generator().manual_seed(3)
    values = torch.cat([torch.randn(20001, generator=g), torch.tensor([0.0, -0.0, -0.0])])
    patterns = values.to(torch.bfloat16).view(torch.int16).numpy().view(numpy.uint16)
    counts = numpy.bincount(patterns, minlength=1 << 16).astype(numpy.int64)
    # sign-magnitude patterns in value order: negatives by falling pattern, then positives
    order_key = numpy.where(patterns >= 0x8000, 0xFFFF - patterns.astype(numpy.int64), patterns.astype(numpy.int64) + 0x8000)  # fmt: skip
    by_value = patterns[numpy.argsort(order_key, kind="stable")]
    ranks = numpy.array([0, 1, 5000, 10001, 10002, 15000, values.numel() - 1])
    found, below = passes.patterns_at_ranks(counts, ranks)
    assert found.tolist() == by_value[ranks].tolist()
    assert below.tolist() == [int(numpy.argmax(by_value == p)) for p in found]


def test_select_in_buckets_matches_a_sort_of_each_bucket() -> None:
    values = gaussian(20_000, seed=9)
    halves = upper_halves(values)
    buckets = [int(b) for b in numpy.unique(halves)[[3, 40, 41]]]
    members = values[numpy.isin(halves, buckets)]
    wanted = [(b, p) for b in buckets for p in (0, int((halves == b).sum()) - 1, int((halves == b).sum()) // 2)]  # fmt: skip
    got = passes.select_in_buckets(members, [b for b, _ in wanted], [p for _, p in wanted])
    expected = [float(numpy.sort(values[halves == b])[p]) for b, p in wanted]
    assert got == expected
