"""GGUF block layouts: the grid a decoder sees, integer codes on it, and the packed bytes.

Every supported type dequantizes one group of weights as `step * code - offset`, in float32
and in that order of operations, which is how gguf's reference dequantizer computes it:

    type  block group  codes      step        offset        bytes per block, in order
    Q8_0    32    32  -128..127  d           0             d, 32 int8
    Q4_0    32    32    -8..7    d           0             d, 16 nibble bytes
    Q5_0    32    32   -16..15   d           0             d, qh (uint32), 16 nibble bytes
    Q4_1    32    32     0..15   d           -m            d, m, 16 nibble bytes
    Q5_1    32    32     0..31   d           -m            d, m, qh (uint32), 16 nibble bytes
    Q4_K   256    32     0..15   d * sc[j]   dmin * mn[j]  d, dmin, 12 scale bytes, 128 nibble
    Q5_K   256    32     0..31   d * sc[j]   dmin * mn[j]  d, dmin, 12 scale bytes, qh 32, 128
    Q6_K   256    16   -32..31   d * sc[j]   0             ql 128, qh 64, 16 int8 sc, d

d, dmin and m are fp16; Q4_K/Q5_K's sc and mn are 6-bit unsigned (packed 8 + 8 into 12 bytes),
Q6_K's sc is int8. Signed codes are stored as code - code_min. A symmetric type's step may be
negative: the block's absmax then lands on the most negative code, which has no positive twin.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Rows handled at once by the passes over a tensor: about 1 MiB of float32, which keeps numpy's
# temporaries in cache (measured: 2-3x faster than whole-tensor passes on a 4096x4096 weight).
CHUNK_VALUES = 1 << 18


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """What a GGUF type stores per block. group_size: weights sharing one step and offset (the
    block, or a K-quant sub-block). affine: the type stores an offset (a min)."""

    qtype: GGMLQuantizationType
    block_size: int
    group_size: int
    code_min: int
    code_max: int
    affine: bool

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def super_block(self) -> bool:
        """K-quants: groups carry integer sub-scales under a fp16 super-block scale."""
        return self.group_size != self.block_size


_Q = GGMLQuantizationType
SPECS: dict[GGMLQuantizationType, BlockSpec] = {
    spec.qtype: spec
    for spec in (
        BlockSpec(_Q.Q8_0, 32, 32, -128, 127, affine=False),
        BlockSpec(_Q.Q4_0, 32, 32, -8, 7, affine=False),
        BlockSpec(_Q.Q5_0, 32, 32, -16, 15, affine=False),
        BlockSpec(_Q.Q4_1, 32, 32, 0, 15, affine=True),
        BlockSpec(_Q.Q5_1, 32, 32, 0, 31, affine=True),
        BlockSpec(_Q.Q4_K, 256, 32, 0, 15, affine=True),
        BlockSpec(_Q.Q5_K, 256, 32, 0, 31, affine=True),
        BlockSpec(_Q.Q6_K, 256, 16, -32, 31, affine=False),
    )
}


def block_spec(qtype: GGMLQuantizationType | str) -> BlockSpec:
    """The spec of `qtype`, given as gguf's enum or its name ("Q4_K", "q4_k")."""
    try:
        key = qtype if isinstance(qtype, GGMLQuantizationType) else _Q[str(qtype).upper()]
        return SPECS[key]
    except KeyError:
        known = ", ".join(q.name for q in SPECS)
        raise ValueError(f"unsupported GGUF type {qtype!r}: choose one of {known}") from None


def group_step_offset(
    spec: BlockSpec,
    d: np.ndarray,
    dmin: np.ndarray | None,
    scales: np.ndarray | None,
    mins: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Step and offset [rows, groups] float32 of the stored fields, computed as gguf's
    dequantizer computes them (fp16 -> float32, then one float32 product), so that
    `step * code - offset` is the decoder's value bit for bit."""
    rows = d.shape[0]
    d32 = d.astype(np.float32)
    if not spec.super_block:
        step = d32
        offset = np.zeros_like(d32) if dmin is None else -dmin.astype(np.float32)
        return step, offset
    assert scales is not None  # a K-quant grid always has sub-block scales
    step = (d32[..., None] * scales.astype(np.float32)).reshape(rows, -1)
    if mins is None or dmin is None:
        return step, np.zeros_like(step)
    offset = (dmin.astype(np.float32)[..., None] * mins.astype(np.float32)).reshape(rows, -1)
    return step, offset


@dataclass(frozen=True, slots=True)
class Grid:
    """The quantization grid of a [rows, cols] weight, as stored in its GGUF blocks.

    d: fp16 [rows, blocks]. dmin: fp16 [rows, blocks]: Q4_1/Q5_1's m (added), Q4_K/Q5_K's dmin
    (times the 6-bit mins, subtracted); None for the other types. scales: K-quant sub-block
    scales [rows, blocks, groups per block], uint8 0..63 (Q4_K/Q5_K) or int8 (Q6_K). mins:
    Q4_K/Q5_K's uint8 0..63 sub-block mins. step, offset: float32 [rows, cols // group_size],
    derived: the decoder's value of code q in group g is step[:, g] * q - offset[:, g].
    """

    spec: BlockSpec
    d: np.ndarray
    dmin: np.ndarray | None = None
    scales: np.ndarray | None = None
    mins: np.ndarray | None = None
    step: np.ndarray = field(init=False, repr=False)
    offset: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        step, offset = group_step_offset(self.spec, self.d, self.dmin, self.scales, self.mins)
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "offset", offset)

    @property
    def qtype(self) -> GGMLQuantizationType:
        return self.spec.qtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * self.spec.block_size


def check_weights(spec: BlockSpec, weights: np.ndarray) -> np.ndarray:
    """`weights` as a float32 [rows, cols] array, refused before any work when it is not 2-D,
    not finite, or cols is not a multiple of the block size."""
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [rows, cols], got shape {w.shape}")
    if w.shape[1] % spec.block_size:
        raise ValueError(
            f"{spec.qtype.name} needs cols to be a multiple of its block size {spec.block_size}, "
            f"got {w.shape[1]} (keep such a tensor in F16/Q8_0, or pad it)"
        )
    if not np.isfinite(w).all():
        raise ValueError("weights contain NaN or Inf: no GGUF grid can hold them")
    return w


def row_chunks(rows: int, cols: int) -> Iterator[slice]:
    """Slices of about CHUNK_VALUES values, whole rows each."""
    step = max(1, CHUNK_VALUES // max(cols, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def rtn_codes(
    spec: BlockSpec, groups: np.ndarray, step: np.ndarray, offset: np.ndarray
) -> np.ndarray:
    """Nearest codes of groups [..., group_size] under step/offset [...], clamped to the type's
    range, as float32. Divides in float64 so that the nearest code is exact; a zero step (an
    all-zero group) gives code 0, which the decoder maps to -offset whatever the code."""
    st = step[..., None].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((groups + offset[..., None].astype(np.float64)) / st)
    q = np.where(st == 0, 0.0, q)
    return np.clip(q, spec.code_min, spec.code_max).astype(np.float32)


def _check_grid_shape(grid: Grid, array: np.ndarray, what: str) -> None:
    if array.shape != grid.shape:
        raise ValueError(f"{what} have shape {array.shape}, the grid is for {grid.shape}")


def codes_for(grid: Grid, weights: np.ndarray) -> np.ndarray:
    """Round-to-nearest codes int8 [rows, cols] of `weights` on `grid`, clamped to the type's
    range. For a fixed grid this minimises every weight's error on its own, whatever the
    importance, which is why the grid search may score codes it then throws away."""
    w = check_weights(grid.spec, weights)
    _check_grid_shape(grid, w, "weights")
    rows, cols = w.shape
    size = grid.spec.group_size
    codes = np.empty((rows, cols), dtype=np.int8)
    for part in row_chunks(rows, cols):
        groups = w[part].reshape(-1, cols // size, size)
        q = rtn_codes(grid.spec, groups, grid.step[part], grid.offset[part])
        codes[part] = q.reshape(-1, cols)
    return codes


def _check_codes(grid: Grid, codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes)
    _check_grid_shape(grid, codes, "codes")
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"codes must be integers, got {codes.dtype}")
    spec = grid.spec
    if codes.size and (codes.min() < spec.code_min or codes.max() > spec.code_max):
        raise ValueError(
            f"{spec.qtype.name} codes must lie in [{spec.code_min}, {spec.code_max}], "
            f"got [{codes.min()}, {codes.max()}]"
        )
    return codes


def dequantized(grid: Grid, codes: np.ndarray) -> np.ndarray:
    """Float32 [rows, cols] values of `codes` on `grid`: step * code - offset, the decoder's
    arithmetic, equal to gguf.quants.dequantize of the packed bytes bit for bit."""
    codes = _check_codes(grid, codes)
    rows, cols = codes.shape
    size = grid.spec.group_size
    q = codes.reshape(rows, -1, size).astype(np.float32)
    values = grid.step[..., None] * q
    if grid.spec.affine:
        values -= grid.offset[..., None]
    return values.reshape(rows, cols)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian bytes of fp16 values (GGUF files are little-endian)."""
    return np.ascontiguousarray(x, dtype="<f2").view(np.uint8).reshape(*x.shape, 2)


def _nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (low & 0x0F) | ((high & 0x0F) << 4)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes of eight 6-bit scales and mins [..., 8]: bytes 0-3 hold sc[0:4] and the top
    2 bits of sc[4:8]; bytes 4-7 hold mn[0:4] and the top 2 bits of mn[4:8]; bytes 8-11 hold
    the low nibbles of sc[4:8] (low) and mn[4:8] (high)."""
    lo_sc, hi_sc = sc[..., :4], sc[..., 4:]
    lo_mn, hi_mn = mn[..., :4], mn[..., 4:]
    first = lo_sc | ((hi_sc >> 4) << 6)
    second = lo_mn | ((hi_mn >> 4) << 6)
    return np.concatenate([first, second, _nibbles(hi_sc, hi_mn)], axis=-1)


def pack(grid: Grid, codes: np.ndarray) -> np.ndarray:
    """GGUF bytes uint8 [rows, cols // block_size * type_size] of `codes` on `grid`, the
    layout gguf.quants.dequantize (and llama.cpp) reads; see the module docstring."""
    codes = _check_codes(grid, codes)
    spec = grid.spec
    rows, cols = codes.shape
    nb = cols // spec.block_size
    u = (codes.astype(np.int16) - spec.code_min).astype(np.uint8).reshape(rows, nb, -1)
    d = _fp16_bytes(grid.d)
    name = spec.qtype.name
    if name == "Q8_0":
        parts = [d, codes.reshape(rows, nb, -1).astype(np.int8).view(np.uint8)]
    elif name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        # element i in the low nibble of byte i, element i + 16 in the high one; Q5's fifth
        # bits form a little-endian uint32, bit i for element i.
        parts = [d] if grid.dmin is None else [d, _fp16_bytes(grid.dmin)]
        if name.startswith("Q5"):
            parts.append(np.packbits(u >> 4, axis=-1, bitorder="little"))
        parts.append(_nibbles(u[..., :16], u[..., 16:]))
    elif name in ("Q4_K", "Q5_K"):
        assert grid.dmin is not None and grid.scales is not None and grid.mins is not None
        parts = [d, _fp16_bytes(grid.dmin), _k_scale_bytes(grid.scales, grid.mins)]
        sub = u.reshape(rows, nb, 8, 32)
        if name == "Q5_K":  # byte l, bit j: the fifth bit of sub-block j's element l
            parts.append(np.packbits(sub >> 4, axis=2, bitorder="little").reshape(rows, nb, 32))
        # 32 bytes per pair of sub-blocks: the even one in the low nibbles
        parts.append(_nibbles(sub[:, :, 0::2], sub[:, :, 1::2]).reshape(rows, nb, 128))
    else:  # Q6_K
        assert grid.scales is not None
        # low nibbles: element h*128 + s*64 + b in byte h*64 + b, nibble s; top 2 bits: element
        # h*128 + s*32 + b in byte h*32 + b, bits 2s and 2s + 1
        low = u.reshape(rows, nb, 2, 2, 64)
        top = (u >> 4).reshape(rows, nb, 2, 4, 32)
        ql = _nibbles(low[:, :, :, 0], low[:, :, :, 1]).reshape(rows, nb, 128)
        qh = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4)
        qh = (qh | (top[:, :, :, 3] << 6)).reshape(rows, nb, 64)
        parts = [ql, qh, grid.scales.astype(np.int8).view(np.uint8), d]
    packed = np.concatenate(parts, axis=-1)
    assert packed.shape[-1] == spec.type_size, (name, packed.shape)
    return packed.reshape(rows, nb * spec.type_size)
