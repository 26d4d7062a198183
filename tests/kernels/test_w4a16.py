"""The W4A16 Triton kernel (in the CPU interpreter) against float64 math, on small and odd
shapes, every group size and path, symmetric and asymmetric, with and without act-order."""

from __future__ import annotations

import pytest
import torch

from llmq.config import QuantArgs
from llmq.errors import InputError
from llmq.kernels import reference
from llmq.kernels.support import TileConfig
from llmq.kernels.w4a16 import DEQUANT_MIN_M, choose_config, dequantize, w4a16_matmul
from llmq.pack.format import (
    PackFormat,
    compress,
    decompress,
    pack_int32,
    unpack_fp4,
    unpack_int32,
)
from llmq.pack.layout import W4A16Weight
from llmq.quant.primitives import quantize_weight
from tests.kernels.conftest import assert_within_bound, poisoned

F16, BF16 = torch.float16, torch.bfloat16


def random_weight(
    n: int, k: int, group_size: int, *, asym: bool, act_order: bool, seed: int = 0
) -> W4A16Weight:
    """Random codes, positive scales and (asymmetric) zero points; groups may end partial."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    codes = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).half()
    zero = torch.randint(-8, 8, (n, groups), dtype=torch.int8, generator=gen) if asym else None
    g_idx = torch.randint(0, groups, (k,), dtype=torch.int32, generator=gen) if act_order else None
    return W4A16Weight(pack_int32(codes, 4), scale, zero, g_idx, k, group_size)


def random_fp4_weight(n: int, k: int, group_size: int, *, seed: int = 0) -> W4A16Weight:
    """Random FP4 bytes (every nibble, negative zero included) as NVFP4 / MXFP4 store them, read
    as int32 words, with positive effective scales per group."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
    scale = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.002).half()
    return W4A16Weight(packed.view(torch.int32), scale, None, None, k, group_size, fp4=True)


def exact_product(x: torch.Tensor, weight: W4A16Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ W^T in float64 with W rebuilt independently of the kernels' reference module (the
    file format's unpacker), and the magnitude |x| @ |W|^T for the error bound."""
    if weight.fp4:
        codes = unpack_fp4(weight.packed.view(torch.uint8)).double()
    else:
        codes = unpack_int32(weight.packed, 4, (weight.out_features, weight.in_features)).double()
    groups = (
        weight.g_idx.long()
        if weight.g_idx is not None
        else torch.arange(weight.in_features) // weight.group_size
    )
    if weight.zero is not None:
        codes = codes - weight.zero.double()[:, groups]
    w = codes * weight.scale.double()[:, groups]
    return x.double() @ w.T, x.double().abs() @ w.abs().T


def tile_config(path: str, group_size: int) -> TileConfig:
    """A small config of each path (split K > 1 for decode), so that CPU tests stay quick."""
    return {
        "decode": TileConfig("decode", 16, 64, min(128, group_size), split_k=3),
        "tiled": TileConfig("tiled", 32, 64, min(64, group_size)),
        "dequant": TileConfig("dequant", 0, 64, min(64, group_size)),
    }[path]


CASES = [  # (M, N, K, group size, asymmetric, act-order, dtype, path)
    (17, 200, 1000, 32, False, False, F16, "decode"),
    (17, 200, 1000, 64, True, False, BF16, "tiled"),
    (17, 200, 1000, 128, False, False, F16, "dequant"),
    (1, 256, 512, 32, True, False, F16, "decode"),
    (1, 256, 512, 64, False, True, BF16, "tiled"),
    (1, 256, 512, 128, True, False, F16, "tiled"),
    (33, 640, 1024, 32, False, False, BF16, "tiled"),
    (33, 640, 1024, 64, True, False, F16, "dequant"),
    (33, 640, 1024, 128, True, True, F16, "decode"),
    (17, 200, 1000, 1000, True, False, F16, "tiled"),  # per channel: one group of all K
]


@pytest.mark.parametrize(("m", "n", "k", "group", "asym", "act_order", "dtype", "path"), CASES)
@pytest.mark.interpreter
def test_kernel_matches_float64(m, n, k, group, asym, act_order, dtype, path) -> None:
    weight = random_weight(n, k, group, asym=asym, act_order=act_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = w4a16_matmul(x, weight, config=tile_config(path, group), out=poisoned(m, n, dtype))
    exact, magnitude = exact_product(x, weight)
    assert_within_bound(out, exact, magnitude, dtype)


FP4_CASES = [  # (M, N, K, group size: 16 NVFP4, 32 MX, dtype, path)
    (1, 96, 256, 16, F16, "decode"),
    (17, 200, 512, 16, BF16, "tiled"),
    (5, 64, 256, 32, F16, "dequant"),
    (33, 160, 512, 32, BF16, "decode"),
]


@pytest.mark.parametrize(("m", "n", "k", "group", "dtype", "path"), FP4_CASES)
@pytest.mark.interpreter
def test_fp4_codes_decode_in_registers(m, n, k, group, dtype, path) -> None:
    """E2M1 codes (NVFP4A16, MXFP4A16 weights) through the same kernel: every nibble decoded
    as compressed-tensors' own layout reads it, against float64 math."""
    weight = random_fp4_weight(n, k, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = w4a16_matmul(x, weight, config=tile_config(path, group), out=poisoned(m, n, dtype))
    exact, magnitude = exact_product(x, weight)
    assert_within_bound(out, exact, magnitude, dtype)
    dequantized = dequantize(weight, torch.float32, block_k=group).double()
    assert torch.equal(dequantized, reference.dequantize_int4(weight, torch.float64))


@pytest.mark.parametrize(
    ("m", "config"),
    [
        (1, TileConfig("decode", 1, 64, 32, split_k=2)),  # one row: the batch-1 dot product
        (17, TileConfig("decode", 16, 64, 32, split_k=3)),
        (17, TileConfig("tiled", 32, 64, 32)),
        (17, TileConfig("dequant", 0, 64, 32)),
    ],
)
@pytest.mark.parametrize(("asym", "act_order"), [(False, False), (True, True)])
@pytest.mark.interpreter
def test_k_major_words_give_the_same_product(m, config, asym, act_order) -> None:
    """What the loader hands the kernels: the packed words stored K-major, read by stride."""
    weight = random_weight(200, 1000, 32, asym=asym, act_order=act_order)
    k_major = weight.k_major()
    assert k_major.packed.stride() == (1, weight.out_features)
    assert torch.equal(k_major.packed, weight.packed)
    x = torch.randn(m, 1000, generator=torch.Generator().manual_seed(2)).half()
    out = w4a16_matmul(x, k_major, config=config, out=poisoned(m, 200, F16))
    exact, magnitude = exact_product(x, weight)
    assert_within_bound(out, exact, magnitude, F16)


@pytest.mark.interpreter
def test_default_dispatch_runs_each_path() -> None:
    weight = random_weight(96, 256, 64, asym=False, act_order=False)
    for m in (1, 40, DEQUANT_MIN_M):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).half()
        exact, magnitude = exact_product(x, weight)
        assert_within_bound(w4a16_matmul(x, weight), exact, magnitude, F16)


@pytest.mark.interpreter
def test_dequantize_kernel_is_exact() -> None:
    weight = random_weight(70, 200, 32, asym=True, act_order=False)
    exact = reference.dequantize_int4(weight, torch.float64)
    assert torch.equal(dequantize(weight, torch.float32, block_k=32).double(), exact)


@pytest.mark.interpreter
def test_reads_what_llmq_quantize_writes() -> None:
    """On-disk tensors from llmq's own quantizer and packer: the kernel's reference weight is
    bit-identical to the file reader's, and the kernel's product agrees with it."""
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    for symmetric in (True, False):
        args = QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=symmetric)
        tensors = compress(quantize_weight(w, args, scale_dtype=F16), PackFormat.PACK_QUANTIZED)
        zero = tensors.get("weight_zero_point")
        weight = W4A16Weight(
            tensors["weight_packed"], tensors["weight_scale"],
            None if zero is None else unpack_int32(zero, 4, (96, 4), packed_dim=0),
            None, 256, 64,
        )  # fmt: skip
        assert torch.equal(reference.dequantize_int4(weight), decompress(tensors, args))
        x = torch.randn(5, 256).half()
        exact, magnitude = exact_product(x, weight)
        assert_within_bound(w4a16_matmul(x, weight), exact, magnitude, F16)


def test_dispatch_rules() -> None:
    cpu = torch.device("cpu")
    for m, rows in ((1, 1), (2, 16), (16, 16)):  # one row: the plain dot product
        config = choose_config(m, 4096, 4096, 128, cpu)
        assert config.path == "decode" and config.block_m == rows
        assert 1 <= config.split_k <= 4096 // config.block_k
    assert choose_config(17, 4096, 4096, 128, cpu).path == "tiled"
    assert choose_config(DEQUANT_MIN_M - 1, 4096, 4096, 128, cpu).path == "tiled"
    assert choose_config(DEQUANT_MIN_M, 4096, 4096, 128, cpu).path == "dequant"
    # K tiles never straddle groups: block_k divides the group size
    assert choose_config(1, 4096, 4096, 32, cpu).block_k == 32
    assert choose_config(64, 4096, 4096, 32, cpu).block_k == 32


def test_shape_and_dtype_errors_are_clear() -> None:
    weight = random_weight(64, 128, 32, asym=False, act_order=False)
    with pytest.raises(InputError, match="columns"):
        w4a16_matmul(torch.randn(2, 64).half(), weight)
    with pytest.raises(InputError, match="dtype int32"):
        w4a16_matmul(torch.ones(2, 128, dtype=torch.int32), weight)
    with pytest.raises(InputError, match="words per row"):
        w4a16_matmul(
            torch.randn(2, 136).half(), W4A16Weight(**{**_fields(weight), "in_features": 136})
        )


def _fields(weight: W4A16Weight) -> dict:
    return {name: getattr(weight, name) for name in W4A16Weight.__slots__}
