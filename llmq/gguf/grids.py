"""Choosing GGUF grids: the stored scales (and mins) that minimise the importance-weighted
squared error sum_i imp_i * (w_i - deq_i)^2 of each group, vectorised over all groups.

Per group (a block, or a K-quant sub-block), with a_i = importance of the weight's column:
  symmetric types (codes -n..n-1): the absmax grid puts the signed extreme on code -n. The
      search tries inverse scales n * f / extreme for f in SPAN_FACTORS, takes each one's
      codes, fits the least-squares scale s = sum(a w q) / sum(a q^2) to them and keeps the fit
      of lowest error, sum(a w^2) - sum(a w q)^2 / sum(a q^2).
  affine types (codes 0..nmax, value s * q + lo): the min/max grid spans [lo, max] with
      lo = min(w), and lo <= 0 for K-quants, whose mins are stored as unsigned offsets. The
      search tries nmax * f / (max - lo) likewise, fits (s, lo) by weighted least squares
      (a 2x2 solve; lo clamped to 0 where K-quants need it) and refines the best fit REFINES
      more times from its own codes.
Then K-quants quantize the sub-block scales against fp16 super-block ones: d = max(s) / 63
(Q4_K/Q5_K, and dmin = max(-lo) / 63) or max|s| / 127 (Q6_K's int8). A non-zero sub-scale is
kept at 1 or more: code 0 still gives the offset, so a coarser grid never does worse than none.
Last, d (and dmin) are refitted by least squares over the whole super-block given those integer
sub-scales and the codes, and kept where the refit lowers the super-block's weighted error.

importance None weighs every weight alike (plain squared error, what the tests measure), not
llama.cpp's heuristic |w|-based weights: with no calibration data there is nothing to say that
larger weights matter more, and for GPTQ the Hessian's diagonal is the importance to pass.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from llmq.gguf.blocks import (
    BlockSpec,
    Grid,
    block_spec,
    check_weights,
    codes_for,
    group_step_offset,
    pack,
    row_chunks,
    rtn_codes,
)

# Candidate code spans, as factors of the type's own (n or nmax). A fixed fraction rather than
# llama.cpp's fixed +-1 code: measured on normal and Student-t weights, the best spread grows
# with the codes (+-1 for 4 bits, +-2 for 5, +-4 for Q6_K, more for Q8_0); 11 candidates cost
# 1.4x 9 and lower the error by 0.1-0.3%, more than 11 by less than 0.1%.
SPAN_FACTORS = 1.0 + np.linspace(-0.1, 0.1, 11)
REFINES = 2
# A 2x2 fit whose determinant is below this fraction of sum(a) * sum(a q^2) has (nearly) one
# distinct code: its solution is rounding noise, so the candidate is skipped.
DEGENERATE = 1e-5
K_SCALE_MAX = 63  # Q4_K/Q5_K's 6-bit sub-block scales and mins
Q6_SCALE_MAX = 127


def choose_grid(
    qtype: GGMLQuantizationType | str,
    weights: np.ndarray,
    importance: np.ndarray | None = None,
    *,
    search: bool = True,
) -> Grid:
    """The grid of `weights` [rows, cols] (rows = out features) for GGUF type `qtype`.

    importance: [cols] float, >= 0, one weight per input column (e.g. GPTQ's Hessian diagonal
    or mean x^2); None weighs all alike. A group whose importance is all zero is treated as
    uniform, so that its weights still get a sensible grid. search=False gives the plain
    absmax (symmetric) or min/max (affine) grid, the baseline the search is measured against.
    """
    spec = block_spec(qtype)
    w = check_weights(spec, weights)
    if w.size == 0:
        raise ValueError(f"cannot quantize an empty weight of shape {w.shape}")
    a = _group_importance(spec, importance, w.shape[1])
    with np.errstate(over="ignore"):  # an fp16 overflow is refused below, with its cause
        parts = [_choose_rows(spec, w[rows], a, search) for rows in row_chunks(*w.shape)]
    fields = [
        None if parts[0][i] is None else np.concatenate([p[i] for p in parts])
        for i in range(len(parts[0]))
    ]
    for name, value in zip(("d", "dmin"), fields[:2], strict=True):
        if value is not None and not np.isfinite(value).all():
            raise ValueError(
                f"weights up to |{np.abs(w).max():g}| overflow {spec.qtype.name}'s fp16 "
                f"{name}: keep this tensor in F32"
            )
    return Grid(spec, *fields)


def quantize(
    qtype: GGMLQuantizationType | str,
    weights: np.ndarray,
    importance: np.ndarray | None = None,
) -> np.ndarray:
    """GGUF bytes uint8 [rows, bytes per row] of `weights` [rows, cols]: choose_grid, then the
    nearest codes on it, packed."""
    grid = choose_grid(qtype, weights, importance)
    return pack(grid, codes_for(grid, weights))


def _group_importance(spec: BlockSpec, importance: np.ndarray | None, cols: int) -> np.ndarray:
    """Importance as float32 [1, groups, group_size], scaled to mean 1 (one factor for the whole
    tensor changes no argmin, and keeps float32 sums in range)."""
    groups = cols // spec.group_size
    if importance is None:
        return np.ones((1, groups, spec.group_size), dtype=np.float32)
    imp = np.asarray(importance, dtype=np.float32)
    if imp.shape != (cols,):
        raise ValueError(f"importance must have shape ({cols},) (one per column), got {imp.shape}")
    if not np.isfinite(imp).all() or (imp < 0).any():
        raise ValueError("importance must be finite and >= 0")
    g = imp.reshape(1, groups, spec.group_size)
    g = np.where(g.sum(-1, keepdims=True) > 0, g, np.float32(1))
    return (g / g.mean()).astype(np.float32)


def _choose_rows(
    spec: BlockSpec, w: np.ndarray, a: np.ndarray, search: bool
) -> tuple[np.ndarray | None, ...]:
    """(d, dmin, scales, mins) of a few rows w [rows, cols]; a: [1, groups, group_size]."""
    rows = w.shape[0]
    groups = w.reshape(rows, -1, spec.group_size)
    if spec.affine:
        s, lo = _affine_fit(
            groups, a, spec.code_max, search, lo_cap=0.0 if spec.super_block else None
        )
    else:
        s, lo = _symmetric_fit(groups, a, -spec.code_min, search), None
    if not spec.super_block:
        return s.astype(np.float16), None if lo is None else lo.astype(np.float16), None, None
    per_block = spec.block_size // spec.group_size
    s = s.reshape(rows, -1, per_block)
    if lo is None:  # Q6_K: signed int8 sub-scales
        d = (np.abs(s).max(-1) / Q6_SCALE_MAX).astype(np.float16)
        scales = np.sign(s) * _sub_scale(np.abs(s), d, Q6_SCALE_MAX)
        fields = (d, None, scales.astype(np.int8), None)
    else:
        mn = -lo.reshape(rows, -1, per_block)
        d = (s.max(-1) / K_SCALE_MAX).astype(np.float16)
        dmin = (mn.max(-1) / K_SCALE_MAX).astype(np.float16)
        with np.errstate(divide="ignore", invalid="ignore"):
            mins = np.where(
                dmin[..., None] > 0, np.rint(mn / dmin[..., None].astype(np.float32)), 0
            )
        scales = _sub_scale(s, d, K_SCALE_MAX).astype(np.uint8)
        fields = (d, dmin, scales, np.clip(mins, 0, K_SCALE_MAX).astype(np.uint8))
    if search:
        fields = _refit_super_scales(
            spec, groups.reshape(rows, -1, per_block, spec.group_size), a, fields
        )
    return fields


def _sub_scale(s: np.ndarray, d: np.ndarray, top: int) -> np.ndarray:
    """Integer sub-scales 1..top of s >= 0 [..., subs] under d [...] (0 where s or d is 0)."""
    d32 = d[..., None].astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(s / d32), 1, top)
    return np.where((d32 > 0) & (s > 0), q, 0).astype(np.float32)


def _symmetric_fit(groups: np.ndarray, a: np.ndarray, n: int, search: bool) -> np.ndarray:
    """Signed scales [...] of groups [..., g] for codes -n..n-1; see the module docstring."""
    where = np.abs(groups).argmax(-1)[..., None]
    extreme = np.take_along_axis(groups, where, -1)[..., 0]
    best_s = extreme / np.float32(-n)
    if not search:
        return best_s
    aw = a * groups
    best = np.zeros_like(best_s)  # error reduction sum(a w q)^2 / sum(a q^2) of best_s
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(extreme != 0, np.float32(-1) / extreme, 0).astype(np.float32)
        for factor in SPAN_FACTORS:
            q = np.clip(np.rint(groups * (inverse * np.float32(n * factor))[..., None]), -n, n - 1)
            num = _total(aw * q)
            den = _total(a * q * q)
            score = np.where(den > 0, num * num / den, 0)
            better = score > best
            best = np.where(better, score, best)
            best_s = np.where(better, num / den, best_s)
    return best_s.astype(np.float32)


def _affine_fit(
    groups: np.ndarray, a: np.ndarray, nmax: int, search: bool, lo_cap: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """Scales and lows [...] of groups [..., g] for values s * q + lo, q in 0..nmax; lo <=
    lo_cap when given. See the module docstring."""
    lo = groups.min(-1)
    if lo_cap is not None:
        lo = np.minimum(lo, np.float32(lo_cap))
    span = groups.max(-1) - lo
    best_s = span / np.float32(nmax)
    if not search:
        return best_s, lo
    aw = a * groups
    sums = (a.sum(-1), _total(aw), _total(aw * groups))  # A, W, WW
    best_s, best_lo = best_s.copy(), lo.copy()
    best_err = np.full_like(best_s, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(span > 0, np.float32(1) / span, 0).astype(np.float32)
        starts = [(inverse * np.float32(nmax * factor), lo) for factor in SPAN_FACTORS]
        for i in range(len(starts) + REFINES):
            inv, low = starts[i] if i < len(starts) else (_safe_inverse(best_s), best_lo)
            q = np.clip(np.rint((groups - low[..., None]) * inv[..., None]), 0, nmax)
            s, fit_lo, err = _fit_affine(a, aw, q, sums, lo_cap)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s = np.where(better, s, best_s)
            best_lo = np.where(better, fit_lo, best_lo)
    return best_s.astype(np.float32), best_lo.astype(np.float32)


def _safe_inverse(s: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(s > 0, np.float32(1) / s, 0).astype(np.float32)


def _fit_affine(
    a: np.ndarray,
    aw: np.ndarray,
    q: np.ndarray,
    sums: tuple[np.ndarray, np.ndarray, np.ndarray],
    lo_cap: float | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted least-squares (s, lo) of w ~ s q + lo given codes q, and its error; the error
    is +inf where the fit is degenerate or s <= 0 (the candidate is then not taken)."""
    A, W, WW = sums
    aq = a * q
    Q, QQ, WQ = _total(aq), _total(aq * q), _total(aw * q)
    det = A * QQ - Q * Q
    s = (A * WQ - Q * W) / det
    lo = (QQ * W - Q * WQ) / det
    if lo_cap is not None:  # K-quants: refit s alone with lo at the cap where lo exceeds it
        capped = lo > lo_cap
        lo = np.where(capped, np.float32(lo_cap), lo)
        s = np.where(capped, (WQ - lo_cap * Q) / QQ, s)
    err = WW - 2 * s * WQ - 2 * lo * W + s * s * QQ + 2 * s * lo * Q + lo * lo * A
    ok = (det > DEGENERATE * A * QQ) & (s > 0) & np.isfinite(err)
    return s, lo, np.where(ok, err, np.inf)


def _refit_super_scales(
    spec: BlockSpec,
    groups: np.ndarray,
    a: np.ndarray,
    fields: tuple[np.ndarray | None, ...],
) -> tuple[np.ndarray | None, ...]:
    """K-quants: refit d (and dmin) by least squares over each super-block given the integer
    sub-scales and the nearest codes, w ~ d * (sc q) - dmin * mn; keep the refit per super-block
    where its own nearest codes lower the weighted error. groups: [rows, blocks, subs, g]."""
    d, dmin, scales, mins = fields
    assert scales is not None
    a4 = a.reshape(1, *groups.shape[1:])
    err, q = _super_block_error(spec, groups, a4, fields)
    sc = scales.astype(np.float32)[..., None]
    u = sc * q  # d's coefficient
    aw, au = a4 * groups, a4 * u
    UU, WU = _total(au * u, axes=2), _total(aw * u, axes=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        if mins is None or dmin is None:
            new_d, new_dmin = WU / UU, None
        else:  # mn is constant per sub-block: its sums need only the per-sub-block ones
            mn = mins.astype(np.float32)
            UV, VV = _total(_total(au) * mn), (a4.sum(-1) * mn * mn).sum(-1)
            WV = _total(_total(aw) * mn)
            det = UU * VV - UV * UV
            new_d = (WU * VV - UV * WV) / det
            new_dmin = (UV * WU - UU * WV) / det
            bad = ~(det > DEGENERATE * UU * VV) | (new_dmin < 0)
            keep = dmin.astype(np.float32)
            new_dmin = np.where(bad, keep, new_dmin)
            new_d = np.where(bad, (WU + keep * UV) / UU, new_d)
    ok = np.isfinite(new_d) & (new_d > 0)
    new_d = np.where(ok, new_d, d).astype(np.float16)
    if new_dmin is not None:
        new_dmin = np.where(ok & np.isfinite(new_dmin), new_dmin, dmin).astype(np.float16)
    refit = (new_d, new_dmin, scales, mins)
    new_err, _ = _super_block_error(spec, groups, a4, refit)
    take = new_err < err
    d = np.where(take, new_d, d)
    if dmin is not None:
        dmin = np.where(take, new_dmin, dmin)
    return d, dmin, scales, mins


def _super_block_error(
    spec: BlockSpec,
    groups: np.ndarray,
    a4: np.ndarray,
    fields: tuple[np.ndarray | None, ...],
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted squared error [rows, blocks] of the nearest codes on the grid `fields`, and
    those codes [rows, blocks, subs, g]."""
    rows, blocks, subs, _ = groups.shape
    step, offset = group_step_offset(spec, *fields)
    step, offset = step.reshape(rows, blocks, subs), offset.reshape(rows, blocks, subs)
    q = rtn_codes(spec, groups, step, offset)
    diff = groups - (step[..., None] * q - offset[..., None])
    return _total(a4 * diff * diff, axes=2), q


def _total(x: np.ndarray, axes: int = 1) -> np.ndarray:
    """Sum over the last `axes` axes, as a product with a vector of ones: numpy's sum over a
    short last axis is about 3x slower than the BLAS product (measured on [64, 128, 32])."""
    flat = x.reshape(*x.shape[: x.ndim - axes], -1)
    return flat @ np.ones(flat.shape[-1], dtype=flat.dtype)
