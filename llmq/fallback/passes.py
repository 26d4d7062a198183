"""The scan's passes over a tensor's values, compiled with numba: each reads every value once,
in blocks that stay in the L1 cache, and releases the GIL so that scan workers run in parallel.

Written as torch or numpy operations, a float32 scan took some 20 whole-tensor passes (about 6 ns
a value on one core): the two compiled passes take about 1.5 ns, packing 8 float32 values a
vector register wherever they can (int32 counters, float64 sums in loops of their own). Every
function works on contiguous 1-D numpy arrays (memory-mapped weights are read in place, never
copied); `histogram`, `float32` and `quartiles` keep the statistics' logic and call these for
the loops. Compiled on first use and cached on disk (`cache=True`), so only the first scan on a
machine pays the compile time (a few seconds); each process still starts LLVM on its first call
(`stats.load_passes`).
"""

from __future__ import annotations

import numpy
from numba import njit

_BLOCK = 4096  # values handled per inner loop: 16 KB of float32, in the L1 cache
_HALF = 16  # a float32's upper 16 bits are its bucket (the value truncated to bfloat16)
_SUMS = {"reassoc", "nsz"}  # lets LLVM vectorise the float64 sums (not NaN-safe min/max)
_MAX_BUCKETS = 4  # the quartiles' order statistics lie in at most four buckets
_INTERLEAVE_FROM = 1 << 19  # values from which a second histogram pays for its zeroing
_GROUP = 64  # patterns summed at once when looking for a rank
# int32 constants: numba widens int32 arithmetic with a Python int to int64, which halves the
# values per vector register (the order-key loop ran at 0.46 cycles a value, 0.15 in int32)
_SIGN_SHIFT = numpy.int32(31)
_MAGNITUDE = numpy.int32(0x7FFFFFFF)
_LOWER_HALF = numpy.int32(0xFFFF)


def float32_summary(values: numpy.ndarray, upper_counts: numpy.ndarray) -> tuple:
    """One pass over float32 `values`: (min, max, sum, sum of squares, any lower half set),
    adding each value's upper-16-bit pattern to `upper_counts` (int64[65536]).

    Sums are float64. min and max are exact for finite values; with a NaN or an infinity
    present, the sum of squares is not finite and min/max mean nothing (the caller filters
    the non-finite values and calls again)."""
    low_key, high_key, total, squares, lower_used = _float32_summary(values, upper_counts)
    return _key_value(low_key), _key_value(high_key), total, squares, lower_used


def float32_refine(
    values: numpy.ndarray,
    buckets: list[int],
    members: numpy.ndarray,
    tail_bounds: tuple[float, float],
    int_grid: tuple[float, float, float, float] | None,
) -> tuple[int, float, int]:
    """One pass over float32 `values`: (count outside `tail_bounds` = (low, high), squared
    integer-quantization error, number of members).

    buckets: one to four upper-16-bit patterns whose values are wanted; they are written to
        `members` (at least as long as those buckets' counts), in order.
    int_grid: (scale, zero point, lowest code, highest code) of per-tensor integer
        quantization, or None for no error (returned as 0.0). The codes are `quantize`'s:
        clamp(round_half_even(x / scale + zero)) in float64, restored as (code - zero) * scale
        in float32 (see `_int_differences`)."""
    if not 1 <= len(buckets) <= _MAX_BUCKETS:
        raise ValueError(f"1 to {_MAX_BUCKETS} buckets, not {len(buckets)}")
    keys = numpy.array([*buckets, *buckets[:1] * (_MAX_BUCKETS - len(buckets))], numpy.uint32)
    low, high = (numpy.float32(bound) for bound in tail_bounds)
    with_error = int_grid is not None
    scale, zero, lowest, highest = (numpy.float32(v) for v in (int_grid or (1.0, 0.0, 0.0, 0.0)))
    return _float32_refine(
        values, keys, members, low, high, with_error, scale, zero, lowest, highest
    )


def select_in_buckets(
    members: numpy.ndarray, buckets: list[int], positions: list[int]
) -> list[float]:
    """For each (bucket, position): the value at that 0-based position in sorted order among
    the float32 `members` whose upper 16 bits are `bucket`."""
    selected = _select_in_buckets(
        members, numpy.asarray(buckets, numpy.uint32), numpy.asarray(positions, numpy.int64)
    )
    return selected.tolist()


def pattern_histogram(patterns: numpy.ndarray, counts: numpy.ndarray) -> None:
    """Add the counts of each unsigned bit pattern (uint16 or uint8 `patterns`) to `counts`."""
    _pattern_histogram(patterns, counts)


def patterns_at_ranks(
    counts: numpy.ndarray, ranks: numpy.ndarray
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """For each of the ascending 0-based `ranks`: the sign-magnitude float bit pattern that
    holds the value at that rank, and how many values lie in the patterns below it in value
    order. `counts` are the counts of every pattern (int64[2^bits]); one walk over them."""
    return _patterns_at_ranks(counts, ranks.astype(numpy.int64))


def _key_value(key: int) -> float:
    """The float32 whose order key (see `_order_key`) is `key`."""
    pattern = numpy.array([_order_key(numpy.int32(key))], dtype=numpy.int32)  # its own inverse
    return float(pattern.view(numpy.float32)[0])


@njit(nogil=True, cache=True, inline="always")
def _order_key(bits):  # pragma: no cover - compiled
    """float32 bit pattern (int32) -> an int32 that orders as the values do: integer min/max
    vectorise where float min/max do not (LLVM keeps them scalar for NaN's sake)."""
    return numpy.int32(bits ^ numpy.int32(numpy.int32(bits >> _SIGN_SHIFT) & _MAGNITUDE))


@njit(nogil=True, cache=True, fastmath=_SUMS)
def _float32_summary(values, upper_counts):  # pragma: no cover - compiled
    bits = values.view(numpy.int32)
    unsigned_bits = values.view(numpy.uint32)
    low_key, high_key = numpy.int32(0x7FFFFFFF), numpy.int32(-0x80000000)
    total = squares = 0.0
    lower_used = False
    odd, interleaved = _odd_histogram(values.size, upper_counts)
    for start in range(0, values.size, _BLOCK):
        block, block_bits = values[start : start + _BLOCK], bits[start : start + _BLOCK]
        low_key, high_key = _key_range(block_bits, low_key, high_key)
        block_total, block_squares = _sums(block)
        total += block_total
        squares += block_squares
        lower_used = lower_used or _any_lower_half(block_bits)
        _count_pairs(unsigned_bits[start : start + _BLOCK], _HALF, upper_counts, odd)
    if interleaved:
        upper_counts += odd
    return low_key, high_key, total, squares, lower_used


@njit(nogil=True, cache=True)
def _odd_histogram(size, counts):  # pragma: no cover - compiled
    """Where odd-numbered values are counted: a second histogram for large inputs (repeated
    increments of one bucket then do not wait on each other; 20% faster), else `counts`."""
    if size >= _INTERLEAVE_FROM:
        return numpy.zeros(counts.size, numpy.int64), True
    return counts, False


@njit(nogil=True, cache=True)
def _key_range(bits, low_key, high_key):  # pragma: no cover - compiled
    for i in range(bits.size):
        key = _order_key(bits[i])
        low_key, high_key = min(low_key, key), max(high_key, key)
    return low_key, high_key


@njit(nogil=True, cache=True, fastmath=_SUMS)
def _sums(block):  # pragma: no cover - compiled
    total = squares = 0.0
    for i in range(block.size):
        value = numpy.float64(block[i])
        total += value
        squares += value * value
    return total, squares


@njit(nogil=True, cache=True)
def _any_lower_half(bits):  # pragma: no cover - compiled
    seen = numpy.int32(0)
    for i in range(bits.size):
        seen = numpy.int32(seen | bits[i])
    return numpy.int32(seen & _LOWER_HALF) != 0


@njit(nogil=True, cache=True)
def _count_pairs(patterns, shift, even, odd):  # pragma: no cover - compiled
    """Count each unsigned pattern >> `shift`: even-numbered values in `even`, odd in `odd`."""
    pairs = patterns.size // 2
    for i in range(pairs):
        even[patterns[2 * i] >> shift] += 1
        odd[patterns[2 * i + 1] >> shift] += 1
    if patterns.size % 2:
        even[patterns[patterns.size - 1] >> shift] += 1


@njit(nogil=True, cache=True)
def _float32_refine(
    values, keys, members, low, high, with_error, scale, zero, lowest, highest
):  # pragma: no cover - compiled
    bits = values.view(numpy.uint32)
    hits = numpy.zeros(_BLOCK, numpy.uint8)
    grid = (scale, zero, lowest, highest)
    differences = numpy.empty(_BLOCK, numpy.float32)
    ties = numpy.zeros(_BLOCK, numpy.uint8)
    indices = numpy.empty(_BLOCK, numpy.int32)  # of a block's hits or ties
    tail, error, found = 0, 0.0, 0
    for start in range(0, values.size, _BLOCK):
        block = values[start : start + _BLOCK]
        tail += _count_outside(block, low, high)
        if with_error:
            error += _int_error(block, grid, differences, ties, indices)
        block_hits = hits[: block.size]
        _mark_buckets(bits[start : start + _BLOCK], keys, block_hits)
        found = _collect(block, block_hits, members, found, indices)
    return tail, error, found


@njit(nogil=True, cache=True)
def _int_error(block, grid, differences, ties, indices):  # pragma: no cover - compiled
    """The block's squared error under the integer `grid` (scratch: a block's room each)."""
    differences, ties = differences[: block.size], ties[: block.size]
    if _int_differences(block, grid, differences, ties):
        _settle_ties(block, grid, differences, ties, indices)
    return _sums(differences)[1]


@njit(nogil=True, cache=True)
def _count_outside(block, low, high):  # pragma: no cover - compiled
    outside = numpy.int32(0)  # a block's count fits; int64 would halve the values per register
    for i in range(block.size):
        outside = numpy.int32(outside + numpy.int32((block[i] < low) | (block[i] > high)))
    return outside


@njit(nogil=True, cache=True)
def _int_differences(block, grid, differences, ties):  # pragma: no cover - compiled
    """Each value's restored value minus itself; marks in `ties` (and counts) the values that
    fell exactly halfway between two codes. `quantize` divides in float64; the division here
    is float32 (8 values to a register, where float64 takes 3x as long), and the two give the
    same code except where the float32 quotient lands exactly on a half: rounding is monotonic
    and every half below 256 is a float32, so a quotient strictly between two halves has the
    float64 one between the same two. `_settle_ties` redoes the ties (about 1 value in 1,000
    of the default model's weights). No fused multiply-add, a true division (no reciprocal),
    round half to even."""
    scale, zero, lowest, highest = grid
    count = numpy.int32(0)
    half = numpy.float32(0.5)
    for i in range(block.size):
        scaled = block[i] / scale + zero
        nearest = numpy.rint(scaled)
        tie = abs(scaled - nearest) == half
        ties[i] = tie
        count = numpy.int32(count + numpy.int32(tie))
        code = min(max(nearest, lowest), highest)
        differences[i] = (code - zero) * scale - block[i]
    return count


@njit(nogil=True, cache=True)
def _settle_ties(block, grid, differences, ties, indices):  # pragma: no cover - compiled
    """The marked values again, with `quantize`'s float64 division."""
    scale, zero, lowest, highest = grid
    for j in range(_flagged(ties, indices)):
        i = indices[j]
        exact = numpy.float64(block[i]) / numpy.float64(scale) + numpy.float64(zero)
        code = min(max(numpy.rint(exact), numpy.float64(lowest)), numpy.float64(highest))
        differences[i] = (numpy.float32(code) - zero) * scale - block[i]


@njit(nogil=True, cache=True)
def _mark_buckets(bits, keys, hits):  # pragma: no cover - compiled
    """hits[i] = 1 where value i lies in one of the four buckets (vectorised compares)."""
    k0, k1, k2, k3 = keys[0], keys[1], keys[2], keys[3]
    for i in range(bits.size):
        key = bits[i] >> _HALF
        hits[i] = (key == k0) | (key == k1) | (key == k2) | (key == k3)


@njit(nogil=True, cache=True)
def _collect(block, hits, members, found, indices):  # pragma: no cover - compiled
    """Append the hit values to `members` (`indices`: room for a block's)."""
    for j in range(_flagged(hits, indices)):
        members[found] = block[indices[j]]
        found += 1
    return found


@njit(nogil=True, cache=True)
def _flagged(flags, indices):  # pragma: no cover - compiled
    """Write the indices of the nonzero `flags` to `indices`, return how many; flags are rare,
    so eight are tested at once."""
    count = 0
    words = flags[: flags.size // 8 * 8].view(numpy.uint64)
    for word in range(words.size):
        if words[word]:
            for i in range(8 * word, 8 * word + 8):
                if flags[i]:
                    indices[count] = i
                    count += 1
    for i in range(words.size * 8, flags.size):
        if flags[i]:
            indices[count] = i
            count += 1
    return count


@njit(nogil=True, cache=True)
def _pattern_histogram(patterns, counts):  # pragma: no cover - compiled
    odd, interleaved = _odd_histogram(patterns.size, counts)
    _count_pairs(patterns, 0, counts, odd)
    if interleaved:
        counts += odd


@njit(nogil=True, cache=True)
def _patterns_at_ranks(counts, ranks):  # pragma: no cover - compiled
    """Value order of sign-magnitude patterns: the negative ones from the largest magnitude
    (all bits set) down to -0 (the sign bit alone), then +0 up to the largest positive.
    Whole groups of patterns are passed over by their sums, most of them empty."""
    patterns = numpy.zeros(ranks.size, numpy.int64)
    below = numpy.zeros(ranks.size, numpy.int64)
    seen, wanted = 0, 0
    for group in range(0, counts.size, _GROUP):
        if wanted == ranks.size:
            break
        in_group = _group_total(counts, group)
        if ranks[wanted] >= seen + in_group:
            seen += in_group
            continue
        for place in range(group, group + _GROUP):
            pattern = _pattern_in_value_order(counts.size, place)
            count = counts[pattern]
            while wanted < ranks.size and ranks[wanted] < seen + count:
                patterns[wanted], below[wanted] = pattern, seen
                wanted += 1
            seen += count
    return patterns, below


@njit(nogil=True, cache=True, inline="always")
def _pattern_in_value_order(size, place):  # pragma: no cover - compiled
    half = size // 2
    return size - 1 - place if place < half else place - half


@njit(nogil=True, cache=True)
def _group_total(counts, group):  # pragma: no cover - compiled
    """Sum of the counts at value-order places group .. group + _GROUP (contiguous patterns:
    descending in the negative half, ascending in the positive one)."""
    first = _pattern_in_value_order(counts.size, group)
    last = _pattern_in_value_order(counts.size, group + _GROUP - 1)
    low, high = min(first, last), max(first, last)
    return counts[low : high + 1].sum()


@njit(nogil=True, cache=True)
def _select_in_buckets(members, buckets, positions):  # pragma: no cover - compiled
    keys = members.view(numpy.uint32) >> _HALF
    selected = numpy.empty(buckets.size, numpy.float64)
    for j in range(buckets.size):
        in_bucket = members[keys == buckets[j]]
        selected[j] = numpy.partition(in_bucket, positions[j])[positions[j]]
    return selected
