"""GGUF's table types: 16 fixed values scaled per group of 32, a 4-bit index per weight.

    type    block  per group of 32                     bytes per block, in order
    IQ4_NL    32   fp16 d                              d, 16 nibble bytes
    IQ4_XS   256   fp16 d (per block) x (ls - 32),     d, scales_h (uint16: 2 high bits of each
                   ls a 6-bit sub-block scale           ls), scales_l (4 bytes: low nibbles), 128
    MXFP4     32   2^(e - 128), e an E8M0 exponent     e, 16 nibble bytes

IQ4_NL/IQ4_XS index llama.cpp's non-uniform 4-bit table (-127 .. 113, denser near zero), MXFP4
the doubled E2M1 values (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12). The decoder's value is the group's
float32 scale times the indexed value (gguf's reference dequantizers compute exactly that). In
each 16 nibble bytes element j sits in the low nibble of byte j, element j + 16 in its high one.

A group's scale is searched like the uniform types' (`llmq.gguf.grids`): candidates around the
ones that map the group's largest weight to either end of the table (a negative scale flips
it), each refitted by weighted least squares given its nearest indices, the lowest
importance-weighted error kept; then rounded to
what the type stores (fp16; IQ4_XS's 6-bit multiples of a per-block fp16; MXFP4's power of two)
and the indices chosen again on the stored scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL, MXFP4

from llmq.gguf.blocks import row_chunks

_Q = GGMLQuantizationType
GROUP = 32
TABLES: dict[GGMLQuantizationType, np.ndarray] = {
    _Q.IQ4_NL: np.array(IQ4_NL.kvalues, dtype=np.float32),
    _Q.IQ4_XS: np.array(IQ4_NL.kvalues, dtype=np.float32),
    _Q.MXFP4: np.array(MXFP4.kvalues, dtype=np.float32),
}
_SPAN = np.linspace(0.8, 1.2, 9)  # candidate scales, relative to the range-matching one


@dataclass(frozen=True, slots=True)
class TableGrid:
    """A [rows, cols] weight's stored scales: `scales` float32 [rows, cols // 32] as the decoder
    computes them; `d` fp16 (IQ4_NL per group, IQ4_XS per block), `ls` IQ4_XS's uint8 sub-block
    scales [rows, blocks, 8], `e` MXFP4's uint8 exponents [rows, groups]."""

    qtype: GGMLQuantizationType
    scales: np.ndarray
    d: np.ndarray | None = None
    ls: np.ndarray | None = None
    e: np.ndarray | None = None


class _Rounder:
    """Nearest table entries by binary search over the midpoints of the sorted table."""

    def __init__(self, table: np.ndarray) -> None:
        self.order = np.argsort(table, kind="stable").astype(np.uint8)
        ranked = table[self.order]
        self.middle = (ranked[1:] + ranked[:-1]) / 2
        self.table = table

    def codes(self, groups: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """Indices [n, 32] of the entries nearest groups / scale (index of 0 where scale is 0)."""
        safe = np.where(scale == 0, 1, scale)[:, None]
        return self.order[np.searchsorted(self.middle, np.where(scale[:, None] == 0, 0, groups / safe))]  # fmt: skip


ROUNDERS = {qtype: _Rounder(table) for qtype, table in TABLES.items()}


def _weighted_error(groups: np.ndarray, weights: np.ndarray, scale: np.ndarray, values: np.ndarray) -> np.ndarray:  # fmt: skip
    return (weights * (groups - scale[:, None] * values) ** 2).sum(-1)


def _best_scales(
    groups: np.ndarray, weights: np.ndarray, qtype: GGMLQuantizationType
) -> np.ndarray:
    """Per group [n, 32], the real scale with the lowest weighted error: candidates around the
    two that put the group's largest weight on either end of the table (a negative scale
    flips the table, so an asymmetric one like IQ4's, -127 .. 113, can give the largest
    magnitude its longer end whatever its sign), each with its nearest indices and then
    refitted by weighted least squares on them (which only lowers the error of those indices;
    the stored scale's own nearest indices lower it again)."""
    table, rounder = TABLES[qtype], ROUNDERS[qtype]
    extreme = groups[np.arange(len(groups)), np.abs(groups).argmax(-1)]
    best = extreme / table.max()
    best_error = np.full(len(groups), np.inf, dtype=groups.dtype)
    for end in (table.min(), table.max()):
        for relative in _SPAN:
            scale = extreme / end * relative
            values = table[rounder.codes(groups, scale)]
            denominator = (weights * values * values).sum(-1)
            safe = np.where(denominator > 0, denominator, 1)
            refit = np.where(denominator > 0, (weights * values * groups).sum(-1) / safe, scale)
            error = _weighted_error(groups, weights, refit, values)
            better = error < best_error
            best, best_error = np.where(better, refit, best), np.where(better, error, best_error)
    return best


def choose_table_grid(qtype: GGMLQuantizationType, weight: np.ndarray, importance: np.ndarray | None = None) -> TableGrid:  # fmt: skip
    """The stored scales of `weight` [rows, cols] under `qtype`, searched against the
    importance-weighted error (importance [cols], the imatrix's mean squared input); rows in
    chunks of about a million values."""
    rows, cols = weight.shape
    table = TABLES[qtype]
    per_column = np.ones(cols, np.float32) if importance is None else importance.astype(np.float32)
    per_column = np.maximum(per_column, 1e-12 * max(float(per_column.max()), 1e-30))
    parts = []
    for part in row_chunks(rows, cols):
        groups = weight[part].reshape(-1, GROUP).astype(np.float32)
        weights = np.broadcast_to(per_column.reshape(-1, GROUP), (part.stop - part.start, cols // GROUP, GROUP)).reshape(-1, GROUP)  # fmt: skip
        best = _best_scales(groups, weights, qtype)
        if qtype == _Q.IQ4_NL:
            d = best.astype(np.float16).reshape(-1, cols // GROUP)
            parts.append(TableGrid(qtype, d.astype(np.float32), d=d))
        elif qtype == _Q.MXFP4:
            parts.append(_mxfp4_grid(groups, weights, best, table, part.stop - part.start))
        else:
            parts.append(_iq4_xs_grid(groups, weights, best, table, part.stop - part.start))
    return _joined(qtype, parts)


def _joined(qtype: GGMLQuantizationType, parts: list[TableGrid]) -> TableGrid:
    def join(field: str) -> np.ndarray | None:
        arrays = [getattr(p, field) for p in parts]
        return None if arrays[0] is None else np.concatenate(arrays)

    scales = join("scales")
    assert scales is not None
    return TableGrid(qtype, scales, d=join("d"), ls=join("ls"), e=join("e"))


def _mxfp4_grid(groups, weights, best, table, rows) -> TableGrid:  # type: ignore[no-untyped-def]
    """The power of two nearest the best scale in log, or its neighbours, whichever errs least."""
    with np.errstate(divide="ignore"):
        center = np.rint(np.log2(np.abs(best.astype(np.float64)))) + 128
    center = np.where(np.isfinite(center), center, 1)
    rounder = ROUNDERS[_Q.MXFP4]
    e_best, error_best = None, None
    for shift in (-1, 0, 1):
        e = np.clip(center + shift, 1, 254).astype(np.uint8)
        scale = MXFP4.e8m0_to_fp32_half(e).astype(np.float32)
        error = _weighted_error(groups, weights, scale, table[rounder.codes(groups, scale)])
        if e_best is None:
            e_best, error_best = e, error
        else:
            better = error < error_best
            e_best, error_best = np.where(better, e, e_best), np.where(better, error, error_best)
    e_best = e_best.astype(np.uint8)
    return TableGrid(_Q.MXFP4, MXFP4.e8m0_to_fp32_half(e_best).reshape(rows, -1), e=e_best.reshape(rows, -1))  # fmt: skip


def _iq4_xs_grid(groups, weights, best, table, rows) -> TableGrid:  # type: ignore[no-untyped-def]
    """Sub-block scales as 6-bit multiples (ls - 32 in -32..31) of a per-block fp16 d: d maps
    the largest sub-block scale to -32 or to 31, whichever errs least over the block."""
    sub = best.reshape(-1, 8)  # [blocks, 8]
    extreme = sub[np.arange(len(sub)), np.abs(sub).argmax(-1)]
    blocks = groups.reshape(len(sub), 8, GROUP)
    block_weights = weights.reshape(len(sub), 8, GROUP)
    chosen, chosen_error = None, None
    for end in (-32.0, 31.0):
        d = (extreme / end).astype(np.float16)
        d32 = d.astype(np.float32)
        safe = np.where(d32 == 0, 1, d32)[:, None]
        ls = np.where(d32[:, None] == 0, 0, np.rint(sub / safe))
        ls = (np.clip(ls, -32, 31) + 32).astype(np.uint8)
        dl = (d.astype(np.float32)[:, None] * (ls.astype(np.float32) - 32)).reshape(-1)
        flat, flat_weights = blocks.reshape(-1, GROUP), block_weights.reshape(-1, GROUP)
        values = table[ROUNDERS[_Q.IQ4_XS].codes(flat, dl)]
        error = _weighted_error(flat, flat_weights, dl, values).reshape(-1, 8).sum(-1)
        if chosen is None:
            chosen, chosen_error = (d, ls), error
        else:
            better = error < chosen_error
            chosen = (np.where(better, d, chosen[0]), np.where(better[:, None], ls, chosen[1]))
            chosen_error = np.where(better, error, chosen_error)
    assert chosen is not None
    d, ls = chosen[0].astype(np.float16), chosen[1].astype(np.uint8)
    scales = d.astype(np.float32)[:, None] * (ls.astype(np.int8) - np.int8(32)).astype(np.float32)
    return TableGrid(_Q.IQ4_XS, scales.reshape(rows, -1), d=d.reshape(rows, -1), ls=ls.reshape(rows, -1, 8))  # fmt: skip


def table_codes(grid: TableGrid, weight: np.ndarray) -> np.ndarray:
    """The index uint8 [rows, cols] of the table entry nearest each weight on the stored scales."""
    rows, cols = weight.shape
    groups = weight.reshape(-1, GROUP).astype(np.float32)
    codes = ROUNDERS[grid.qtype].codes(groups, grid.scales.reshape(-1))
    return codes.reshape(rows, cols)


def table_dequantized(grid: TableGrid, codes: np.ndarray) -> np.ndarray:
    """Float32 values of `codes`: the group's scale times the table entry, as gguf decodes."""
    rows, cols = codes.shape
    values = TABLES[grid.qtype][codes.reshape(rows, -1, GROUP)]
    return (grid.scales[..., None] * values).reshape(rows, cols)


def pack_table(grid: TableGrid, codes: np.ndarray) -> np.ndarray:
    """GGUF bytes uint8 [rows, blocks x type size] of `codes` on `grid` (module docstring)."""
    rows, cols = codes.shape
    block, size = GGML_QUANT_SIZES[grid.qtype]
    nibbles = codes.reshape(rows, -1, 2, 16)
    packed_codes = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).astype(
        np.uint8
    )  # [rows, groups, 16]
    if grid.qtype == _Q.IQ4_NL:
        assert grid.d is not None
        parts = [_fp16(grid.d), packed_codes]
    elif grid.qtype == _Q.MXFP4:
        assert grid.e is not None
        parts = [grid.e[..., None], packed_codes]
    else:
        assert grid.d is not None and grid.ls is not None
        ls = grid.ls.astype(np.uint16)  # [rows, blocks, 8]
        high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype("<u2")
        low = (ls[..., 0::2] & 0x0F) | ((ls[..., 1::2] & 0x0F) << 4)
        blocks = cols // block
        parts = [
            _fp16(grid.d),
            np.ascontiguousarray(high).view(np.uint8).reshape(rows, blocks, 2),
            low.astype(np.uint8),
            packed_codes.reshape(rows, blocks, 128),
        ]
    packed = np.concatenate(parts, axis=-1)
    assert packed.shape[-1] == size, (grid.qtype.name, packed.shape)
    return packed.reshape(rows, -1)


def _fp16(d: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(d, dtype="<f2").view(np.uint8).reshape(*d.shape, 2)
