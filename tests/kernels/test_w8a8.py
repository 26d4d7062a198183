"""W8A8-INT8 and FP8 Triton kernels (in the CPU interpreter): the fused-in activation
quantization is code-for-code the reference's (and llmq eval's), the GEMM agrees with float64."""

from __future__ import annotations

import pytest
import torch

from llmq.config import QuantArgs
from llmq.errors import InputError
from llmq.kernels import reference
from llmq.kernels.support import TileConfig
from llmq.kernels.w8a8 import choose_config, quantize_rows, w8a8_matmul
from llmq.pack.layout import FP8_CODES, W8A8Weight
from llmq.quant.primitives import fake_quantize
from tests.kernels.conftest import assert_within_bound, poisoned

F16, BF16 = torch.float16, torch.bfloat16


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """N(0, 1) rows with the hard cases: an all-zero row, an outlier row, a single-spike row."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0] = 0.0
    if m > 2:
        x[1, 3] = 900.0  # one huge channel: every other code of the row rounds to 0 or +-1
        x[2] = 0.0
        x[2, k - 1] = -3.0
    return x.to(dtype)


def weight_codes(n: int, k: int, fp8: bool, seed: int = 0) -> W8A8Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    scale = w.abs().amax(dim=1) / (reference.FP8_MAX if fp8 else reference.INT8_MAX)
    scaled = w / scale[:, None]
    codes = scaled.clamp(-448, 448).to(FP8_CODES) if fp8 else scaled.round().to(torch.int8)
    return W8A8Weight(codes, scale.float())


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [F16, BF16, torch.float32])
@pytest.mark.interpreter
def test_activation_quantization_matches_reference_code_for_code(fp8, dtype) -> None:
    x = activations(9, 1000, dtype)
    codes, scale = quantize_rows(x, fp8)
    ref_codes, ref_scale = reference.quantize_rows(x, fp8)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes.view(torch.int8), ref_codes.view(torch.int8))
    assert not torch.isnan(scale).any() and (codes.float()[0] == 0).all()  # zero row
    # the row maximum saturates exactly at the top code
    top = reference.FP8_MAX if fp8 else reference.INT8_MAX
    assert codes.float().abs().amax(dim=1)[1:].eq(top).all()


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
def test_reference_quantization_is_what_llmq_eval_simulates(fp8) -> None:
    x = activations(9, 640, torch.float32)
    codes, scale = reference.quantize_rows(x, fp8)
    args = QuantArgs(num_bits=8, type="float" if fp8 else "int", strategy="token", dynamic=True)
    assert torch.equal(codes.float() * scale[:, None], fake_quantize(x, args))


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.interpreter
def test_static_scale_quantization_matches_reference_and_eval(fp8) -> None:
    """One calibrated scale for every row; inputs beyond the calibrated range saturate (int8 at
    -128 and 127, as llmq eval's static simulation does)."""
    x = activations(9, 640, torch.float32)
    static = torch.tensor([0.01 if not fp8 else 0.003])  # rows reach 900: far out of range
    codes, scale = quantize_rows(x, fp8, static)
    ref_codes, ref_scale = reference.quantize_rows(x, fp8, static)
    assert torch.equal(scale, ref_scale) and torch.equal(scale, static.expand(9))
    assert torch.equal(codes.view(torch.int8), ref_codes.view(torch.int8))
    low, high = (-448.0, 448.0) if fp8 else (-128.0, 127.0)
    assert codes.float().min() == low and codes.float().max() == high
    args = QuantArgs(num_bits=8, type="float" if fp8 else "int", strategy="tensor")
    assert torch.equal(ref_codes.float() * ref_scale[:, None], fake_quantize(x, args, static))
    with pytest.raises(InputError, match="input_scale"):
        quantize_rows(x, fp8, torch.tensor([1.0, 2.0]))


@pytest.mark.interpreter
def test_static_gemm_matches_float64() -> None:
    weight = weight_codes(200, 1000, fp8=False)
    static = torch.tensor([0.02])
    weight = W8A8Weight(weight.codes, weight.scale, static)
    x = activations(17, 1000, F16)
    out = w8a8_matmul(x, weight, config=TileConfig("decode", 16, 64, 128, split_k=3))
    codes, x_scale = reference.quantize_rows(x, False, static)
    scales = x_scale.double()[:, None] * weight.scale.double()[None, :]
    exact = (codes.double() @ weight.codes.double().T) * scales
    magnitude = (codes.double().abs() @ weight.codes.double().abs().T) * scales
    assert_within_bound(out, exact, magnitude, F16)


@pytest.mark.interpreter
def test_round_half_to_even_like_torch() -> None:
    # absmax 127 gives scale 1: the codes are the values rounded, ties to even
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -2.49]])
    codes, _ = quantize_rows(x, fp8=False)
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2, 126, -2]]


CASES = [  # (M, N, K, dtype, path)
    (17, 200, 1000, F16, "decode"),
    (1, 256, 512, BF16, "decode"),
    (33, 640, 1024, F16, "tiled"),
    (17, 200, 1000, BF16, "tiled"),
]


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize(("m", "n", "k", "dtype", "path"), CASES)
@pytest.mark.interpreter
def test_gemm_matches_float64(fp8, m, n, k, dtype, path) -> None:
    weight = weight_codes(n, k, fp8)
    x = activations(m, k, dtype)
    config = (
        TileConfig("decode", 16, 64, 128, split_k=3)
        if path == "decode"
        else TileConfig("tiled", 32, 64, 64)
    )
    out = w8a8_matmul(x, weight, config=config, out=poisoned(m, n, dtype))
    codes, x_scale = reference.quantize_rows(x, fp8)
    scales = x_scale.double()[:, None] * weight.scale.double()[None, :]
    exact = (codes.double() @ weight.codes.double().T) * scales
    magnitude = (codes.double().abs() @ weight.codes.double().abs().T) * scales
    assert_within_bound(out, exact, magnitude, dtype)


@pytest.mark.interpreter
def test_default_dispatch() -> None:
    weight = weight_codes(96, 256, fp8=False)
    for m in (1, 40, 100):
        x = activations(m, 256, F16, seed=m)
        expected = reference.w8a8_linear(x, weight)
        assert torch.allclose(
            w8a8_matmul(x, weight).float(), expected.float(), rtol=2e-3, atol=1e-3
        )
    cpu = torch.device("cpu")
    assert choose_config(16, 4096, 4096, False, cpu).path == "decode"
    assert choose_config(17, 4096, 4096, False, cpu).path == "tiled"


def test_errors_are_clear() -> None:
    weight = weight_codes(64, 128, fp8=False)
    with pytest.raises(InputError, match="columns"):
        w8a8_matmul(torch.randn(2, 64).half(), weight)
    with pytest.raises(InputError, match="scales for 64 outputs"):
        w8a8_matmul(torch.randn(2, 128).half(), W8A8Weight(weight.codes, weight.scale[:10]))
    with pytest.raises(InputError, match="dtype float16"):
        w8a8_matmul(torch.randn(2, 128).half(), W8A8Weight(weight.codes.half(), weight.scale))
