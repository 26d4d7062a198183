"""The compiled CPU loops against the torch ops they stand in for: GPTQ's column loop and the
clipping search's rounding errors."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.quant import gptq, rtn
from tests.quant.conftest import run_gptq

INT4_G64 = QuantArgs(num_bits=4, strategy="group", group_size=64)
INT4_G64_ASYM = QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=False)
INT8_CHANNEL = QuantArgs(num_bits=8, strategy="channel")


@pytest.mark.parametrize("args", [INT4_G64, INT4_G64_ASYM, INT8_CHANNEL], ids=lambda a: a.label)
@pytest.mark.parametrize("actorder", ["static", "none"])
@pytest.mark.integration
def test_same_bits_as_the_torch_loop_on_real_weights(
    monkeypatch: pytest.MonkeyPatch,
    real_weights: dict[str, Tensor],
    real_hessians: dict[str, Tensor],
    args: QuantArgs,
    actorder: str,
) -> None:
    """Codes, scales, zero points and losses are bit-identical: each step rounds as torch's
    does (float64 codes, one rounding to float32, a fused multiply-add per update)."""
    for name in ("self_attn.q_proj", "mlp.down_proj"):  # both input widths
        weight, h = real_weights[name], real_hessians[name]
        torch_loop, compiled = (
            run_gptq(monkeypatch, loop, weight, h, args, actorder=actorder)
            for loop in ("torch", "compiled")
        )
        for attribute in ("codes", "scale", "zero_point"):
            expected = getattr(torch_loop.weight, attribute)
            got = getattr(compiled.weight, attribute)
            assert (got is None) == (expected is None)
            assert got is None or torch.equal(got, expected), (name, attribute)
        assert torch.equal(compiled.row_loss, torch_loop.row_loss), name


def test_fp8_codes_keep_the_torch_loop() -> None:
    block = torch.zeros(4, 8)
    assert gptq.compiled_loop_applies(block, integer_codes=True)
    assert not gptq.compiled_loop_applies(block, integer_codes=False)
    assert not gptq.compiled_loop_applies(block.T, integer_codes=True)  # not contiguous
    assert not gptq.compiled_loop_applies(block.half(), integer_codes=True)


@pytest.mark.parametrize("args", [INT4_G64, INT4_G64_ASYM, INT8_CHANNEL], ids=lambda a: a.label)
@pytest.mark.parametrize("weighted", [True, False], ids=["output", "mse"])
@pytest.mark.integration
def test_clip_search_picks_the_same_ratios(
    monkeypatch: pytest.MonkeyPatch,
    real_weights: dict[str, Tensor],
    real_hessians: dict[str, Tensor],
    args: QuantArgs,
    weighted: bool,
) -> None:
    """The compiled rounding errors are bit-identical, so every group's shrink factor is too
    (a near tie between two factors would otherwise flip)."""
    calls = []
    compiled = rtn.clip_deltas
    monkeypatch.setattr(rtn, "clip_deltas", lambda *a: calls.append(1) or compiled(*a))
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        weight = real_weights[name]
        hessian = real_hessians[name] if weighted else None
        calls.clear()
        with monkeypatch.context() as patch:
            patch.setattr(rtn, "compiled_loop_applies", lambda *_: False)
            expected = rtn.clip_ratios(weight, args, hessian=hessian)
        assert not calls
        got = rtn.clip_ratios(weight, args, hessian=hessian)
        assert calls
        assert torch.equal(got, expected), name


@pytest.mark.parametrize(
    ("args", "actorder"), [(INT4_G64, "static"), (INT4_G64_ASYM, "none")], ids=["static", "none"]
)
@pytest.mark.interpreter
def test_gpu_kernel_gives_the_compiled_loops_bits(
    monkeypatch: pytest.MonkeyPatch, args: QuantArgs, actorder: str
) -> None:
    """The Triton column loop (run here by Triton's interpreter; on a GPU in the benchmarks)
    rounds every step as the compiled loop does, so GPTQ's codes, scales, zero points and
    losses are bit-identical. "none" starts a group's range mid-block (group 64 in a block of
    128): the kernel's loop starts at column 64 and still updates the block's later columns."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 256, generator=generator)
    x = torch.randn(512, 256, generator=generator) * torch.rand(256, generator=generator)
    h = 2 * x.T @ x / len(x)
    compiled, kernel = (
        run_gptq(monkeypatch, loop, weight, h, args, actorder=actorder)
        for loop in ("compiled", "triton")
    )
    for attribute in ("codes", "scale", "zero_point"):
        expected, got = getattr(compiled.weight, attribute), getattr(kernel.weight, attribute)
        assert (got is None) == (expected is None)
        assert got is None or torch.equal(got, expected), attribute
    assert torch.equal(kernel.row_loss, compiled.row_loss)
