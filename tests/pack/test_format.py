"""Packing is bit-exact with compressed-tensors' own packing and unpacking."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from llmq.config import QuantArgs, get_scheme
from llmq.pack.format import (
    PackFormat,
    compress,
    decompress,
    pack_fp4,
    pack_int32,
    quantization_config,
    unpack_fp4,
    unpack_int32,
)
from llmq.pack.layout import E2M1_MAGNITUDES
from llmq.quant.primitives import quantize_weight


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("shape", [(5, 37), (16, 576), (3, 8), (7, 1)])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_pack_matches_compressed_tensors(
    num_bits: int, shape: tuple[int, int], packed_dim: int
) -> None:
    low, high = -(1 << (num_bits - 1)), 1 << (num_bits - 1)
    codes = torch.randint(low, high, shape, dtype=torch.int8)
    packed = pack_int32(codes, num_bits, packed_dim=packed_dim)
    assert torch.equal(packed, pack_to_int32(codes, num_bits, packed_dim=packed_dim))
    assert torch.equal(unpack_int32(packed, num_bits, shape, packed_dim=packed_dim), codes)
    theirs = unpack_from_int32(packed, num_bits, torch.Size(shape), packed_dim=packed_dim)
    assert torch.equal(theirs, codes)


@pytest.mark.parametrize(
    ("args", "fmt"),
    [
        (QuantArgs(num_bits=4, strategy="group", group_size=32), PackFormat.PACK_QUANTIZED),
        (
            QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False),
            PackFormat.PACK_QUANTIZED,
        ),
        (QuantArgs(num_bits=8, strategy="channel"), PackFormat.PACK_QUANTIZED),
        (QuantArgs(num_bits=8, strategy="channel"), PackFormat.INT_QUANTIZED),
        (QuantArgs(num_bits=8, type="float", strategy="channel"), PackFormat.FLOAT_QUANTIZED),
    ],
)
def test_compress_decompress_round_trip(args: QuantArgs, fmt: PackFormat) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 96)
    q = quantize_weight(w, args)
    tensors = compress(q, fmt)
    assert torch.equal(decompress(tensors, args), q.dequantize())
    if fmt is PackFormat.PACK_QUANTIZED:
        assert tensors["weight_packed"].dtype == torch.int32
        assert tensors["weight_packed"].shape == (24, 96 * args.num_bits // 32)
        assert tensors["weight_shape"].tolist() == [24, 96]
        assert ("weight_zero_point" in tensors) == (not args.symmetric)


def test_group_index_checkpoints_dequantize_per_column() -> None:
    """An actorder="group" checkpoint (llm-compressor before compressed-tensors 0.20) assigns
    each column a group through weight_g_idx; every column uses its own group's scale and zero."""
    gen = torch.Generator().manual_seed(0)
    args = QuantArgs(num_bits=4, strategy="group", group_size=16, symmetric=False)
    codes = torch.randint(-8, 8, (6, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(6, 4, generator=gen) + 0.1
    zero = torch.randint(-8, 8, (6, 4), generator=gen, dtype=torch.int8)
    g_idx = torch.randperm(64, generator=gen) // 16
    q = quantize_weight(torch.zeros(6, 64), args)  # only for the packing layout
    tensors = compress(type(q)(codes, scale, zero, args), PackFormat.PACK_QUANTIZED)
    tensors["weight_g_idx"] = g_idx.to(torch.int32)
    expected = (codes.double() - zero.double()[:, g_idx]) * scale.double()[:, g_idx]
    assert torch.allclose(decompress(tensors, args).double(), expected, atol=1e-6)


def _e2m1_codes(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Random E2M1 values (every magnitude, both signs, negative zero included)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.tensor(E2M1_MAGNITUDES)[torch.randint(0, 8, shape, generator=gen)]
    sign = torch.randint(0, 2, shape, generator=gen).bool()
    return torch.where(sign, -magnitude, magnitude)


def test_fp4_packing_matches_compressed_tensors() -> None:
    """Two codes a byte, the even column in the low nibble, as compressed-tensors packs and
    unpacks them (negative zero keeps its sign bit on both sides)."""
    codes = _e2m1_codes((9, 64))
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (9, 32)
    assert torch.equal(packed, pack_fp4_to_uint8(codes.to(torch.bfloat16)))
    assert torch.equal(unpack_fp4(packed).float(), codes)
    assert torch.equal(unpack_fp4_from_uint8(packed, 9, 64, dtype=torch.float32), codes)
    signs = torch.signbit(unpack_fp4(pack_fp4(torch.tensor([[-0.0, 0.0]]))).float())
    assert signs.tolist() == [[True, False]]


@pytest.mark.parametrize("name", ["nvfp4a16", "nvfp4", "mxfp4a16", "mxfp4", "mxfp8"])
def test_fp4_and_mx_formats_decompress_in_compressed_tensors(name: str) -> None:
    """What llmq writes, compressed-tensors' own decompressor reads back to exactly llmq's
    values (in the bfloat16 it returns; NVFP4's power-of-two global scale keeps them exact)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = get_scheme(name)
    torch.manual_seed(3)
    w = (torch.randn(48, 192) * torch.rand(48, 1)).to(torch.bfloat16)
    q = quantize_weight(w, scheme.weights)
    fmt = PackFormat(scheme.format)
    tensors = compress(q, fmt)
    assert torch.equal(decompress(tensors, scheme.weights), q.dequantize())
    config = quantization_config(
        [(scheme.weights, scheme.input_activations, ["Linear"])], ignore=[], fmt=fmt
    )
    ct_scheme = QuantizationScheme(**config["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(fmt.value)
    theirs = compressor.decompress(dict(tensors), ct_scheme)["weight"]
    assert torch.equal(theirs.float(), q.dequantize())
    expected = {
        "nvfp4": {"weight_packed", "weight_scale", "weight_global_scale"},
        "mxfp4": {"weight_packed", "weight_scale"},
        "mxfp8": {"weight", "weight_scale"},
    }[name.removesuffix("a16")]
    assert set(tensors) == expected
