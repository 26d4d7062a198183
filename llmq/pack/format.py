"""compressed-tensors, exactly: packing, per-linear tensor names, and `quantization_config`.

Tensors of one quantized linear `P` (e.g. `model.layers.0.mlp.down_proj`):
- pack-quantized (W4A16, W8A16):  P.weight_packed int32 [out, ceil(in * bits / 32)],
  P.weight_scale [out, groups], P.weight_shape int64 [2], and for asymmetric weights
  P.weight_zero_point int32 [ceil(out * bits / 32), groups] (codes packed along dim 0).
- int-quantized (W8A8):  P.weight int8 [out, in], P.weight_scale [out, 1].
- float-quantized (FP8): P.weight float8_e4m3fn [out, in], P.weight_scale [out, 1].
- nvfp4-pack-quantized:  P.weight_packed uint8 [out, in / 2] (two E2M1 codes a byte, the even
  column in the low nibble; a nibble is sign << 3 | the magnitude's index in 0, 0.5, 1, 1.5, 2,
  3, 4, 6), P.weight_scale float8_e4m3fn [out, in / 16], P.weight_global_scale float32 [1].
- mxfp4-pack-quantized:  P.weight_packed as NVFP4's, P.weight_scale uint8 [out, in / 32] (E8M0:
  the scale is 2^(byte - 127)).
- mxfp8-quantized:  P.weight float8_e4m3fn [out, in], P.weight_scale uint8 as MXFP4's.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from llmq.config import QuantArgs, Scheme
from llmq.io.layout import EXPERT
from llmq.pack.layout import E2M1_MAGNITUDES
from llmq.quant.floats import E8M0_DTYPE
from llmq.quant.primitives import DenseWeight, QuantizedWeight, dequantize, scale_codes


class PackFormat(str, Enum):
    """The `format` field of quantization_config (compressed-tensors' CompressionFormat)."""

    # weight_packed: int32 [out, ceil(in * bits / 32)]; code v is stored as v + 2**(bits-1) in
    # bits [j*bits, (j+1)*bits) of word j // (32 // bits) (W4: 8 codes per int32, low bits first).
    PACK_QUANTIZED = "pack-quantized"
    INT_QUANTIZED = "int-quantized"  # weight: int8 codes as-is
    FLOAT_QUANTIZED = "float-quantized"  # weight: float8_e4m3fn values as-is
    DENSE = "dense"  # weight: floating point as-is (pruned, not quantized; no quantization_config)
    NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"  # weight_packed: FP4 codes two a byte
    MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
    MXFP8_QUANTIZED = "mxfp8-quantized"  # weight: float8_e4m3fn codes as-is, E8M0 scales


def pack_fp4(codes: Tensor) -> Tensor:
    """FP4 codes (E2M1 values in any float dtype) [rows, cols] -> uint8 [rows, cols / 2]."""
    values = codes.to(torch.float32)
    grid = torch.tensor(E2M1_MAGNITUDES, device=codes.device)
    nibbles = torch.searchsorted(grid, values.abs()).to(torch.uint8)
    nibbles |= torch.signbit(values).to(torch.uint8) << 3
    pairs = nibbles.reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack_fp4(packed: Tensor) -> Tensor:
    """`pack_fp4`'s inverse: float8_e4m3fn codes [rows, 2 · packed columns]."""
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    grid = torch.tensor(E2M1_MAGNITUDES, device=packed.device)
    magnitude = grid[(nibbles & 0x07).long()]
    return torch.where(nibbles >= 8, -magnitude, magnitude).to(torch.float8_e4m3fn)


FP4_PACKED = (PackFormat.NVFP4_PACK_QUANTIZED, PackFormat.MXFP4_PACK_QUANTIZED)
# the formats compressed-tensors decompresses to bfloat16 whatever the model's dtype
DECOMPRESSED_TO_BFLOAT16 = (*FP4_PACKED, PackFormat.MXFP8_QUANTIZED)


MIXED_PRECISION = "mixed-precision"  # quantization_config's format when its groups differ


def weight_format(args: QuantArgs | None, scheme: PackFormat) -> PackFormat:
    """The format a linear with weights `args` is written in under a scheme of format `scheme`:
    the scheme's own, except for a budget's candidate of another kind (FP4, MX or FP8 weights
    chosen under an integer scheme, integer weights under a float one)."""
    if args is None:
        return scheme
    if args.type == "int":
        return scheme if scheme in (PackFormat.PACK_QUANTIZED, PackFormat.INT_QUANTIZED) else PackFormat.PACK_QUANTIZED  # fmt: skip
    if args.num_bits == 4:
        tensor_group = args.strategy == "tensor_group"
        return PackFormat.NVFP4_PACK_QUANTIZED if tensor_group else PackFormat.MXFP4_PACK_QUANTIZED
    return PackFormat.MXFP8_QUANTIZED if args.scale_dtype == "uint8" else PackFormat.FLOAT_QUANTIZED


def _shared_format(formats: list[str], scheme: PackFormat) -> str:
    """The top-level format: the groups' one format, else compressed-tensors' mixed-precision."""
    distinct = set(formats)
    if not distinct:
        return scheme.value
    return distinct.pop() if len(distinct) == 1 else MIXED_PRECISION


def config_formats(config: dict[str, Any] | None) -> set[str]:
    """The formats a quantization_config's groups are written in (its own where they share one)."""
    if not config:
        return set()
    groups = (config.get("config_groups") or {}).values()
    return {group.get("format") or config.get("format") for group in groups} - {None}


def input_scale_name(args: QuantArgs) -> str:
    """The leaf of a linear's calibrated input scale: NVFP4's global scale, else input_scale."""
    return "input_global_scale" if args.dynamic == "local" else "input_scale"


def _disk_scale(scale: Tensor) -> Tensor:
    """Scales as stored: E8M0 as its exponent byte (compressed-tensors' uint8)."""
    return scale.view(torch.uint8) if scale.dtype == E8M0_DTYPE else scale


def decompress_scale(scale: Tensor, args: QuantArgs) -> Tensor:
    """`_disk_scale`'s inverse: a uint8 exponent read back as the E8M0 scale it is."""
    return scale.view(E8M0_DTYPE) if args.scale_dtype == "uint8" else scale


def pack_int32(codes: Tensor, num_bits: int, *, packed_dim: int = 1) -> Tensor:
    """Pack signed int8 codes [rows, cols] into int32 words along `packed_dim`."""
    if num_bits not in (4, 8):
        raise ValueError(f"packing supports 4 and 8 bits, not {num_bits}")
    values = codes.to(torch.int32) + (1 << (num_bits - 1))
    if packed_dim == 0:
        values = values.T
    per_word = 32 // num_bits
    rows, cols = values.shape
    pad = -cols % per_word
    values = torch.nn.functional.pad(values, (0, pad)).reshape(rows, -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int32, device=codes.device) * num_bits
    # Shifted fields occupy disjoint bits, so their sum is their bitwise OR; int32 wraps
    # the top field into the sign bit exactly as the on-disk layout requires.
    packed = (values << shifts).sum(dim=-1, dtype=torch.int32)
    return (packed.T if packed_dim == 0 else packed).contiguous()


def unpack_int32(
    packed: Tensor, num_bits: int, shape: tuple[int, int], *, packed_dim: int = 1
) -> Tensor:
    """Inverse of `pack_int32`: signed int8 codes of the original `shape`."""
    per_word = 32 // num_bits
    words = packed.T if packed_dim == 0 else packed
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * num_bits
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    values = fields.reshape(words.shape[0], -1) - (1 << (num_bits - 1))
    rows, cols = (shape[1], shape[0]) if packed_dim == 0 else shape
    values = values[:rows, :cols]
    return (values.T if packed_dim == 0 else values).to(torch.int8).contiguous()


def scheme_format(scheme: Scheme) -> PackFormat:
    return PackFormat(scheme.format)


def compress(q: QuantizedWeight | DenseWeight, fmt: PackFormat) -> dict[str, Tensor]:
    """On-disk tensors of one linear, keyed by suffix (`weight_packed`, ...)."""
    if isinstance(q, DenseWeight):
        return {"weight": q.values.contiguous()}
    out: dict[str, Tensor] = {"weight_scale": _disk_scale(q.scale).contiguous()}
    if q.global_scale is not None:
        out["weight_global_scale"] = q.global_scale.reshape(1).contiguous()
    if fmt in FP4_PACKED:
        out["weight_packed"] = pack_fp4(q.codes)
    elif fmt is PackFormat.PACK_QUANTIZED:
        out["weight_packed"] = pack_int32(q.codes, q.args.num_bits)
        out["weight_shape"] = torch.tensor(q.codes.shape, dtype=torch.int64)
        if q.zero_point is not None:
            out["weight_zero_point"] = pack_int32(q.zero_point, q.args.num_bits, packed_dim=0)
    else:
        out["weight"] = q.codes.contiguous()
        if q.zero_point is not None:
            out["weight_zero_point"] = q.zero_point.contiguous()
    return out


def decompress(tensors: dict[str, Tensor], args: QuantArgs) -> Tensor:
    """Float32 weight [out, in] from the on-disk tensors of one linear (any of the formats)."""
    scale = decompress_scale(tensors["weight_scale"], args)
    zero = tensors.get("weight_zero_point")
    if "weight_packed" in tensors and args.type == "float":
        codes = unpack_fp4(tensors["weight_packed"])
    elif "weight_packed" in tensors:
        shape = tuple(int(d) for d in tensors["weight_shape"].tolist())
        codes = unpack_int32(tensors["weight_packed"], args.num_bits, shape)
        if zero is not None:
            zero = unpack_int32(zero, args.num_bits, (shape[0], scale.shape[-1]), packed_dim=0)
    else:
        codes = tensors["weight"]
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None and args.strategy == "group":
        return _dequantize_by_group_index(codes, scale, zero, g_idx.long())
    return dequantize(codes, scale, zero, args, tensors.get("weight_global_scale"))


def _dequantize_by_group_index(
    codes: Tensor, scale: Tensor, zero: Tensor | None, g_idx: Tensor
) -> Tensor:
    """Older GPTQ checkpoints (actorder "group") name each input column's group in g_idx."""
    return scale_codes(codes, scale[:, g_idx], None if zero is None else zero[:, g_idx])


def config_target(suffix: str) -> str:
    """A config group's regex target for a module-name suffix (`mlp.experts.*.up_proj`): any
    expert index where it says EXPERT."""
    return "re:.*" + re.escape(suffix).replace(re.escape(f".{EXPERT}."), r"\.\d+\.") + "$"


def quantization_config(
    groups: list[tuple[QuantArgs, QuantArgs | None, list[str]]],
    *,
    ignore: list[str],
    fmt: PackFormat,
    kv_cache: QuantArgs | None = None,
) -> dict[str, Any]:
    """config.json's `quantization_config`, built with compressed-tensors' own types.

    groups: (weight args, input activation args, targets) per config group; each linear must
    match exactly one group's targets. kv_cache: the `kv_cache_scheme` (k_scale / v_scale on
    each attention module), if the cache is quantized.
    """
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    def ct_args(args: QuantArgs | None) -> QuantizationArgs | None:
        if args is None:
            return None
        fields = args.model_dump(exclude_none=True)
        if "block_structure" in fields:
            fields["block_structure"] = list(fields["block_structure"])
        if "scale_dtype" in fields:
            fields["scale_dtype"] = f"torch.{fields['scale_dtype']}"
        return QuantizationArgs(**fields)

    formats = [weight_format(weights, fmt).value for weights, _, _ in groups]
    config_groups = {
        f"group_{i}": QuantizationScheme(
            targets=targets,
            weights=ct_args(weights),
            input_activations=ct_args(activations),
            format=group_format,
        )
        for i, ((weights, activations, targets), group_format) in enumerate(zip(groups, formats, strict=True))
    }  # fmt: skip
    config = QuantizationConfig(
        config_groups=config_groups,
        format=_shared_format(formats, fmt),
        quantization_status="compressed",
        ignore=ignore,
        kv_cache_scheme=ct_args(kv_cache),
    )
    return config.to_dict()
