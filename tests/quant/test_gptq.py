"""GPTQ against a float64 transcription of the paper's algorithm, and on real activations."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from llmq.config import QuantArgs, get_scheme, group_width
from llmq.errors import NumericalError
from llmq.quant.awq import output_error
from llmq.quant.gptq import gptq_quantize_weight
from llmq.quant.masks import Sparsity, pruned_mask
from llmq.quant.primitives import (
    DenseWeight,
    QuantizedWeight,
    expand_block_scale,
    int_range,
    quantize_weight,
)
from llmq.quant.rtn import rtn_quantize_weight
from tests.quant.conftest import nearest_e2m1, run_gptq

INT4_G32 = QuantArgs(num_bits=4, strategy="group", group_size=32)
INT4_G32_ASYM = QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False)
INT8_CHANNEL = QuantArgs(num_bits=8, strategy="channel")
INT4_CHANNEL_ASYM = QuantArgs(num_bits=4, strategy="channel", symmetric=False)
INT8_BLOCK = QuantArgs(num_bits=8, strategy="block", block_structure=(16, 32))
NVFP4, MXFP4, MXFP8 = (get_scheme(name).weights for name in ("nvfp4a16", "mxfp4a16", "mxfp8"))


def reference_gptq(
    w: Tensor,
    h: Tensor,
    args: QuantArgs,
    *,
    actorder: str,
    damp: float,
    sparsity: Sparsity | None = None,
    block: int = 32,
) -> Tensor:
    """Algorithm 1 of arXiv 2210.17323 in float64, one column at a time with the full update
    (no lazy blocks). Group ranges: from the original weights (static) or from the updated
    weights at each group's first column (none). With `sparsity`, SparseGPT's (arXiv
    2301.00774, Algorithm 1): the mask is chosen from the updated weights by w² / Hinv[j, j]²,
    at every `block`-th column for the block (unstructured) or at every M-th for the N:M group
    (§3.4), and pruned weights get the code of zero. Returns the codes (integers, or the FP8 /
    FP4 values of float grids)."""
    w, h = w.double().clone(), h.double().clone()
    cols = w.shape[1]
    h += damp * h.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    group = group_width(args) or cols
    order = (
        torch.argsort(h.diagonal(), descending=True, stable=True)
        if actorder == "static"
        else torch.arange(cols)
    )
    hinv = torch.linalg.cholesky(torch.linalg.inv(h[order][:, order]), upper=True)
    scale, zero = _per_row(quantize_weight(w, args, scale_dtype=torch.float64), w.shape[0])
    codes = torch.zeros_like(w, dtype=torch.int64 if args.type == "int" else torch.float64)
    pruned = torch.zeros_like(w, dtype=torch.bool)
    for pos, j in enumerate(order.tolist()):
        if sparsity is not None and j % mask_span(sparsity, block) == 0:
            span = slice(j, j + mask_span(sparsity, block))
            pruned[:, span] = pruned_mask((w[:, span] / hinv.diagonal()[span]).square(), sparsity, start=j)  # fmt: skip
        g = j // group
        if actorder == "none" and j % group == 0:
            fresh = quantize_weight(w[:, j : j + group], args, scale_dtype=torch.float64)
            fresh_scale, fresh_zero = _per_row(fresh, w.shape[0])
            scale[:, g] = fresh_scale.reshape(-1)
            if zero is not None:
                zero[:, g] = fresh_zero.reshape(-1)
        z = 0 if zero is None else zero[:, g].double()
        code = _on_grid(w[:, j] / scale[:, g] + z, args)
        code = torch.where(pruned[:, j], z, code) if zero is not None else code.masked_fill(pruned[:, j], 0)  # fmt: skip
        codes[:, j] = code.to(codes.dtype)
        err = (w[:, j] - (code - z) * scale[:, g]) / hinv[pos, pos]
        later = order[pos:]
        w[:, later] -= err[:, None] * hinv[pos, pos:][None, :]
    return codes


def _on_grid(scaled: Tensor, args: QuantArgs) -> Tensor:
    """The nearest code: an integer in range, an E4M3 value (torch's cast, saturated), or an
    E2M1 value (the float64 reference of test_floats)."""
    if args.type == "int":
        return torch.clamp(torch.round(scaled), *int_range(args.num_bits))
    if args.num_bits == 8:
        return scaled.clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return torch.tensor([nearest_e2m1(x) for x in scaled.tolist()], dtype=torch.float64)


def _per_row(q: QuantizedWeight, rows: int) -> tuple[Tensor, Tensor | None]:
    """Stored scales and zero points [rows, groups] (a block's repeated on each of its rows;
    NVFP4's over its global scale: what codes multiply), in float64."""
    scale = q.scale.double() / (1.0 if q.global_scale is None else q.global_scale.double())
    scale = expand_block_scale(scale, q.args, rows).reshape(rows, -1)
    zero = None if q.zero_point is None else q.zero_point.reshape(rows, -1)
    return scale, zero


def _correlated_problem(seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 128, generator=gen, dtype=torch.float64)
    x = x @ torch.randn(128, 128, generator=gen, dtype=torch.float64) * 0.3 + x
    x *= torch.rand(128, generator=gen, dtype=torch.float64) * 4  # uneven channel magnitudes
    return torch.randn(48, 128, generator=gen, dtype=torch.float64), 2 * x.T @ x / x.shape[0]


@pytest.mark.parametrize(
    "args",
    [INT4_G32, INT4_G32_ASYM, INT8_CHANNEL, INT4_CHANNEL_ASYM, INT8_BLOCK],
    ids=lambda a: a.label,
)
@pytest.mark.parametrize("actorder", ["static", "none"])
@pytest.mark.parametrize("loop", ["compiled", "torch"])
def test_codes_match_float64_reference(
    monkeypatch: pytest.MonkeyPatch, args: QuantArgs, actorder: str, loop: str
) -> None:
    w, h = _correlated_problem()
    got = run_gptq(
        monkeypatch, loop, w, h, args, block_size=32, actorder=actorder,
        scale_dtype=torch.float64,
    )  # fmt: skip
    expected = reference_gptq(w, h, args, actorder=actorder, damp=0.01)
    assert torch.equal(got.weight.codes.long(), expected)
    assert got.dampening_frac == 0.01


def test_loss_is_the_damped_quadratic_error() -> None:
    """Sequential OBS updates add up to exactly ½ tr(ΔW H ΔWᵀ) on the damped Hessian."""
    w, h = _correlated_problem(1)
    got = gptq_quantize_weight(w, h, INT4_G32, scale_dtype=torch.float64)
    delta = got.weight.dequantize(torch.float64) - w
    damped = h + 0.01 * h.diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    assert got.loss == pytest.approx(0.5 * float(((delta @ damped) * delta).sum()), rel=1e-6)


def test_float32_run_matches_float64_up_to_rounding_ties() -> None:
    w, h = _correlated_problem(2)
    exact = gptq_quantize_weight(w, h, INT4_G32, scale_dtype=torch.float32).weight.codes
    fast = gptq_quantize_weight(w.float(), h.float(), INT4_G32).weight.codes
    assert (exact != fast).float().mean() < 0.01


@pytest.mark.parametrize("args", [INT4_G32_ASYM, INT8_CHANNEL], ids=lambda a: a.label)
@pytest.mark.integration
def test_lower_output_error_than_rtn_on_real_activations(
    real_hessians: dict[str, Tensor], real_weights: dict[str, Tensor], args: QuantArgs
) -> None:
    for name in ("self_attn.q_proj", "mlp.down_proj"):  # both input widths; the others cost time
        weight, h = real_weights[name], real_hessians[name]
        gptq = gptq_quantize_weight(weight, h, args).weight.dequantize()
        rtn = rtn_quantize_weight(weight, args).dequantize()
        gptq_err = float(output_error(gptq - weight, h))
        rtn_err = float(output_error(rtn - weight, h))
        assert gptq_err < 0.9 * rtn_err, name


@pytest.mark.parametrize("args", [INT4_G32_ASYM, INT8_CHANNEL], ids=lambda a: a.label)
@pytest.mark.integration
def test_weights_stacked_by_rows_quantize_as_each_alone(
    real_hessians: dict[str, Tensor], real_weights: dict[str, Tensor], args: QuantArgs
) -> None:
    """Rows are independent given H: how the pipeline quantizes q/k/v (and gate/up) at once."""
    h = real_hessians["self_attn.q_proj"]
    weights = [real_weights["self_attn.q_proj"], real_weights["mlp.gate_proj"]]
    stacked = gptq_quantize_weight(torch.cat(weights), h, args)
    sizes = [len(w) for w in weights]
    parts = stacked.weight.split_rows(sizes)
    for weight, part, row_loss in zip(weights, parts, stacked.row_loss.split(sizes), strict=True):
        alone = gptq_quantize_weight(weight, h, args)
        assert torch.equal(part.codes, alone.weight.codes)
        assert torch.equal(part.scale, alone.weight.scale)
        assert (part.zero_point is None) == (alone.weight.zero_point is None)
        if part.zero_point is not None:
            assert torch.equal(part.zero_point, alone.weight.zero_point)
        assert float(row_loss.sum()) == pytest.approx(alone.loss, rel=1e-5)


def test_scales_that_span_rows_cannot_be_split() -> None:
    w, _ = _correlated_problem(7)
    per_tensor = quantize_weight(w, QuantArgs(num_bits=8, strategy="tensor"))
    with pytest.raises(ValueError, match="tensor scales span rows"):
        per_tensor.split_rows([16, 32])


def test_dead_inputs_get_zero_weight() -> None:
    w, h = _correlated_problem(3)
    h[5, :] = 0.0
    h[:, 5] = 0.0
    got = gptq_quantize_weight(w, h, INT4_G32_ASYM, scale_dtype=torch.float64).weight
    assert torch.all(got.dequantize(torch.float64)[:, 5] == 0)


def test_indefinite_hessian_raises_dampening_step_by_step() -> None:
    w, h = _correlated_problem(4)
    mean = float(h.diagonal().mean())
    h[7, :] = 0.0
    h[:, 7] = 0.0
    h[7, 7] = -0.05 * mean  # an eigenvalue of -5% of the mean diagonal: 1% dampening fails
    got = gptq_quantize_weight(w, h, INT4_G32)
    assert got.dampening_frac == pytest.approx(0.1)
    assert torch.isfinite(got.weight.scale).all()


def test_hopeless_hessian_is_a_numerical_error() -> None:
    w, h = _correlated_problem(5)
    with pytest.raises(NumericalError, match="not positive definite"):
        gptq_quantize_weight(w, -h, INT4_G32)


@pytest.mark.parametrize(
    "args",
    [
        QuantArgs(num_bits=8, type="float", strategy="channel"),
        QuantArgs(num_bits=8, type="float", strategy="block", block_structure=(16, 32)),
    ],
    ids=lambda a: a.label,
)
def test_fp8_weights(args: QuantArgs) -> None:
    w, h = _correlated_problem(6)
    w = w[:40]  # 2.5 row blocks: the last block is partial
    got = gptq_quantize_weight(w.float(), h.float(), args)
    assert got.weight.codes.dtype == torch.float8_e4m3fn
    rtn = rtn_quantize_weight(w.float(), args)
    # static act-order: scales from the original weights, stored as RTN stores them
    assert torch.equal(got.weight.scale, rtn.scale)
    gptq_err = output_error(got.weight.dequantize() - w.float(), h)
    assert gptq_err < output_error(rtn.dequantize() - w.float(), h)


@pytest.mark.parametrize(
    ("args", "actorder"),
    [(NVFP4, "static"), (MXFP4, "static"), (MXFP4, "none"), (MXFP8, "static"), (MXFP8, "none")],
    ids=lambda v: v if isinstance(v, str) else v.label,
)
def test_float_grids_match_float64_reference(args: QuantArgs, actorder: str) -> None:
    """GPTQ on the FP4 and MX grids: codes rounded to E2M1 / E4M3 against the stored
    (E4M3 or E8M0) scales, as the float64 transcription does. NVFP4's global scale comes from
    the original weights (the reference's fresh per-group ranges would take a new one: static
    act-order only)."""
    w, h = _correlated_problem(7)
    got = gptq_quantize_weight(w, h, args, block_size=32, actorder=actorder)
    expected = reference_gptq(w, h, args, actorder=actorder, damp=0.01)
    assert torch.equal(got.weight.codes.double(), expected)
    rtn = quantize_weight(w, args)
    assert output_error(got.weight.dequantize(torch.float64) - w, h) < output_error(
        rtn.dequantize(torch.float64) - w, h
    )


@pytest.mark.parametrize("args", [INT4_G32, INT4_G32_ASYM, INT8_CHANNEL], ids=lambda a: a.label)
@pytest.mark.parametrize(
    "sparsity",
    # 16:64: an N:M group wider than a quantization group (g32)
    [Sparsity(fraction=0.5), Sparsity(pattern=(2, 4)), Sparsity(pattern=(16, 64))],
    ids=lambda s: s.label,
)
@pytest.mark.parametrize("loop", ["compiled", "torch"])
def test_sparsegpt_matches_its_float64_reference(
    monkeypatch: pytest.MonkeyPatch, args: QuantArgs, sparsity: Sparsity, loop: str
) -> None:
    """SparseGPT in GPTQ's solver: the same masks and codes as the paper's algorithm written
    out in float64; each row loses exactly its share (or N of every M), and pruned weights
    dequantize to exactly zero, asymmetric schemes included."""
    w, h = _correlated_problem()
    got = run_gptq(
        monkeypatch, loop, w, h, args, block_size=32, actorder="none", scale_dtype=torch.float64,
        sparsity=sparsity,
    )  # fmt: skip
    expected = reference_gptq(w, h, args, actorder="none", damp=0.01, sparsity=sparsity)
    assert torch.equal(got.weight.codes.long(), expected)
    zeros = got.weight.dequantize(torch.float64) == 0
    if sparsity.pattern is not None:
        n, m = sparsity.pattern
        assert torch.all(zeros.reshape(w.shape[0], -1, m).sum(-1) >= m - n)
    else:  # pruned, plus weights that happened to round to zero
        assert torch.all(zeros.sum(1) >= w.shape[1] // 2)


def test_sparsegpt_loses_less_output_than_magnitude_pruning_then_rtn() -> None:
    """Choosing the mask inside the solver, with the updates, loses less of the layer's output
    than the `magnitude` method (smallest |w| zeroed, then RTN) at the same sparsity."""
    w, h = _correlated_problem(seed=3)
    half = Sparsity(fraction=0.5)
    joint = gptq_quantize_weight(w, h, INT4_G32, actorder="none", scale_dtype=torch.float64, sparsity=half)  # fmt: skip
    pruned = w.masked_fill(pruned_mask(w.abs(), half), 0)
    separate = rtn_quantize_weight(pruned, INT4_G32, scale_dtype=torch.float64)
    assert torch.all((separate.dequantize(torch.float64) == 0).sum(1) >= 64)  # still 50% sparse
    errors = [float(output_error(q.dequantize(torch.float64) - w, h)) for q in (joint.weight, separate)]  # fmt: skip
    assert errors[0] < 0.5 * errors[1]


def mask_span(sparsity: Sparsity, block: int) -> int:
    """Columns whose mask SparseGPT chooses at once: a block, or one N:M group."""
    return sparsity.pattern[1] if sparsity.pattern is not None else block


def reference_sparsegpt_prune(
    w: Tensor, h: Tensor, sparsity: Sparsity, block: int = 32, span: int | None = None
) -> Tensor:
    """SparseGPT pruning alone (arXiv 2301.00774, Algorithm 1 without quantization) in float64,
    one column at a time with the full update: at every `span`-th column (a block, or an N:M
    group) the mask of the next `span` columns is chosen from the updated weights by
    w² / Hinv[j, j]²; a pruned weight's whole value is its error, spread over the later
    columns; kept weights have none. Returns the pruned weight."""
    w, h = w.double().clone(), h.double().clone()
    cols = w.shape[1]
    h += 0.01 * h.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    hinv = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    pruned = torch.zeros_like(w, dtype=torch.bool)
    span = span or mask_span(sparsity, block)
    for j in range(cols):
        if j % span == 0:
            scores = (w[:, j : j + span] / hinv.diagonal()[j : j + span]).square()
            pruned[:, j : j + span] = pruned_mask(scores, sparsity, start=j)
        err = torch.where(pruned[:, j], w[:, j], 0.0) / hinv[j, j]
        w[:, j:] -= err[:, None] * hinv[j, j:][None, :]
        w[:, j] = torch.where(pruned[:, j], 0.0, w[:, j])
    return w


@pytest.mark.parametrize(
    "sparsity", [Sparsity(fraction=0.5), Sparsity(pattern=(2, 4))], ids=lambda s: s.label
)
def test_sparsegpt_pruning_alone_matches_its_float64_reference(sparsity: Sparsity) -> None:
    """`llmq prune --method sparsegpt`: the solver with nothing rounded gives the paper's
    weights, each row losing exactly its share (or N of every M)."""
    w, h = _correlated_problem(seed=2)
    got = gptq_quantize_weight(w, h, None, block_size=32, actorder="none", sparsity=sparsity)
    assert isinstance(got.weight, DenseWeight) and got.weight.values.dtype == w.dtype
    expected = reference_sparsegpt_prune(w, h, sparsity)
    assert torch.equal(got.weight.values == 0, expected == 0)
    torch.testing.assert_close(got.weight.values, expected, rtol=1e-9, atol=1e-12)
    zeros = got.weight.values == 0
    if sparsity.pattern is not None:
        assert torch.all(zeros.reshape(w.shape[0], -1, 4).sum(-1) == 2)
    else:
        assert torch.all(zeros.sum(1) == w.shape[1] // 2)
    # the update pays: less output lost than the same share of the smallest |w| dropped
    magnitude = w.masked_fill(pruned_mask(w.abs(), sparsity), 0)
    assert output_error(got.weight.values - w, h) < 0.7 * output_error(magnitude - w, h)
    if sparsity.pattern is not None:  # and N:M groups chosen as the loop reaches them pay too
        block_start = reference_sparsegpt_prune(w, h, sparsity, span=32)
        assert output_error(got.weight.values - w, h) < output_error(block_start - w, h)
