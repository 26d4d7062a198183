"""Quantization primitives, in compressed-tensors' format so that what we write is what vLLM and
transformers read back (code * scale, with a zero point when asymmetric).

Integer weights, symmetric:  scale = max(-min / -qmin, max / qmax)
    The group's extreme lands exactly on a code: -8 for a negative extreme, +7 for a positive
    one (int4). compressed-tensors uses absmax / 7.5, which puts the extreme half a step off
    the grid; on SmolLM2 W4A16 g64 the exact extreme cuts the perplexity increase from +43% to
    +40% (held-out pydoc) and from +38% to +32% (Hamlet) in benchmarks/RESULTS.md.
Integer, asymmetric:  scale = (max - min) / (qmax - qmin), zero = qmin - round(min / scale)
    (min <= 0 <= max so that 0.0 is exact)
Activations, dynamic per token:  scale = absmax / qmax, as the int8 kernels compute it at run time.
code = clamp(round(x / scale) + zero, qmin, qmax);  x' = (code - zero) * scale
FP8 E4M3: scale = absmax / 448;  code = float8_e4m3fn(clamp(x / scale, -448, 448))  (saturating)
FP4 E2M1, NVFP4 and MX scales: `llmq.quant.floats`.
Blocks (FP8 128x128): one scale per tile of the weight; a partial tile at the bottom edge
    takes the range of the rows it has (compressed-tensors pads with zeros, which changes no range).
Static activations: one calibrated scale per tensor, code = clamp(round(x / scale)) as above.

Scales are rounded to their storage dtype *before* codes are computed, so dequantizing the
stored tensors reproduces exactly the weights llmq evaluated. Rounding divides in float64 so
that integer codes are exact, whatever the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from llmq.config import QuantArgs, group_width
from llmq.quant.floats import (
    FP8_DTYPE,
    effective_scale,
    float_code_max,
    fp8_group_scale,
    mx_scale,
    nvfp4_global_scale,
    to_float_grid_,
)

ACCUM_DTYPE = torch.float32
# Strategies whose scales belong to single rows: a weight's rows can be quantized apart or
# stacked with another weight's (a per-tensor or block scale spans rows).
ROW_STRATEGIES = ("channel", "group")
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def int_range(num_bits: int) -> tuple[int, int]:
    """Signed code range, e.g. (-8, 7) for 4 bits."""
    return -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A quantized [out, in] weight. codes: int8 (integer types) or float8_e4m3fn (FP8 and FP4
    values), [out, in]. scale: [out, groups] ([out, 1] per channel, [1] per tensor), in its
    storage dtype. zero_point: int8 like scale, asymmetric only. global_scale: float32 [1],
    NVFP4 only (the values are codes · scale / global_scale)."""

    codes: Tensor
    scale: Tensor  # block strategy: [ceil(out / block rows), in / block columns]
    zero_point: Tensor | None
    args: QuantArgs
    global_scale: Tensor | None = None

    def dequantize(self, dtype: torch.dtype = ACCUM_DTYPE) -> Tensor:
        values = dequantize(self.codes, self.scale, self.zero_point, self.args, self.global_scale)
        return values.to(dtype)

    @classmethod
    def joined_rows(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """One weight from the weights of consecutive rows (per-row scales): `split_rows`'s
        inverse."""
        zeros = [part.zero_point for part in parts]
        return cls(
            torch.cat([part.codes for part in parts]), torch.cat([part.scale for part in parts]),
            None if zeros[0] is None else torch.cat(zeros), parts[0].args,  # type: ignore[arg-type]
        )  # fmt: skip

    def split_rows(self, sizes: list[int]) -> list[QuantizedWeight]:
        """The weights of a row-stacked weight, apart again (per-row scales only; NVFP4's parts
        keep the stack's one global scale). Each part gets its own storage: safetensors refuses
        to save tensors that share memory."""
        if self.args.strategy not in (*ROW_STRATEGIES, "tensor_group"):
            raise ValueError(f"{self.args.strategy} scales span rows: the weight cannot be split")
        zeros = self.zero_point.split(sizes) if self.zero_point is not None else [None] * len(sizes)

        def own(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.clone()

        return [
            QuantizedWeight(
                codes.clone(), scale.clone(), own(zero), self.args, own(self.global_scale)
            )
            for codes, scale, zero in zip(
                self.codes.split(sizes), self.scale.split(sizes), zeros, strict=True
            )
        ]


@dataclass(frozen=True, slots=True)
class DenseWeight:
    """A weight kept in floating point: pruned, not quantized (the DENSE scheme of `llmq
    prune`). The same interface as QuantizedWeight where the pipeline uses it."""

    values: Tensor
    args: None = None

    def dequantize(self, dtype: torch.dtype = ACCUM_DTYPE) -> Tensor:
        return self.values.to(dtype)

    def split_rows(self, sizes: list[int]) -> list[DenseWeight]:
        return [DenseWeight(part.clone()) for part in self.values.split(sizes)]


def as_groups(x: Tensor, args: QuantArgs) -> Tensor:
    """View x [rows, cols] as [rows or 1, groups, group_len] for the reduction of `args.strategy`."""
    rows, cols = x.shape
    if args.strategy == "tensor":
        return x.reshape(1, 1, rows * cols)
    if args.strategy in ("channel", "token"):
        return x.reshape(rows, 1, cols)
    group_size = int(group_width(args) or 0)
    if cols % group_size:
        raise ValueError(f"group size {group_size} does not divide {cols} columns")
    return x.reshape(rows, cols // group_size, group_size)


def block_rows(args: QuantArgs) -> int:
    """Rows sharing one scale: a block's height, else 1 (a block is a group of its width
    whose scale spans that many rows)."""
    return args.block_structure[0] if args.block_structure is not None else 1


def rows_per_block(values: Tensor, args: QuantArgs, reduce: Callable[..., Tensor]) -> Tensor:
    """Per-row group values [rows, groups] reduced over each block's rows -> [blocks, groups].
    Padding rows are 0, neutral for ranges (which always include 0)."""
    height = block_rows(args)
    if height == 1:
        return values
    pad = -values.shape[0] % height
    padded = torch.nn.functional.pad(values, (0, 0, 0, pad))
    return reduce(padded.reshape(-1, height, values.shape[1]), dim=1)


def expand_block_scale(scale: Tensor, args: QuantArgs, rows: int) -> Tensor:
    """Stored per-block scales [blocks, groups] -> one row per weight row [rows, groups]."""
    height = block_rows(args)
    return scale if height == 1 else scale.repeat_interleave(height, dim=0)[:rows]


def _stored_shape(scale: Tensor, args: QuantArgs) -> Tensor:
    return scale.reshape(1) if args.strategy == "tensor" else scale


def choose_qparams(
    min_vals: Tensor,
    max_vals: Tensor,
    args: QuantArgs,
    *,
    scale_dtype: torch.dtype,
    global_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Scale (in `scale_dtype`, or the format's own) and integer zero point (asymmetric only)
    for the given ranges; NVFP4 group scales are relative to `global_scale`."""
    min_vals = torch.clamp(min_vals.to(torch.float64), max=0.0)
    max_vals = torch.clamp(max_vals.to(torch.float64), min=0.0)
    if args.type == "float":
        absmax = torch.maximum(-min_vals, max_vals)
        if args.scale_dtype == "uint8":
            return mx_scale(absmax, args), None
        if args.strategy == "tensor_group":
            if global_scale is None:
                raise ValueError("NVFP4 group scales need the tensor's global scale")
            return fp8_group_scale(absmax, global_scale), None
        return _storable(absmax / FP8_MAX, scale_dtype), None
    qmin, qmax = int_range(args.num_bits)
    if args.symmetric and args.dynamic:
        return _storable(torch.maximum(-min_vals, max_vals) / qmax, scale_dtype), None
    if args.symmetric:
        return _storable(torch.maximum(min_vals / qmin, max_vals / qmax), scale_dtype), None
    scale = _storable((max_vals - min_vals) / (qmax - qmin), scale_dtype)
    zero = torch.clamp(torch.round(qmin - min_vals / scale.to(torch.float64)), qmin, qmax)
    return scale, zero.to(torch.int8)


def _storable(scale: Tensor, scale_dtype: torch.dtype) -> Tensor:
    """Round to the storage dtype; an all-zero range gets the dtype's eps (no division by 0)."""
    scale = scale.to(scale_dtype)
    eps = torch.finfo(scale_dtype).eps
    return torch.where(scale == 0, torch.full_like(scale, eps), scale)


def quantize_grouped(groups: Tensor, scale: Tensor, zero: Tensor | None, args: QuantArgs) -> Tensor:
    """Codes for `groups` [r, g, n] with per-group scale/zero [r, g] (NVFP4: the effective
    scale): int8 or float8_e4m3fn. One float64 working copy, rounded and clamped in place:
    three times faster than a new tensor per step on million-value chunks (the scan and RTN
    spend most of their time here).

    E4M3 codes of values and scales float32 holds exactly (a bfloat16 weight as it is stored,
    or its float32 copy: the same codes) are computed in float32, the same bytes at half the
    work: a division is correctly rounded, so the float64 quotient rounded to float32 is the
    float32 quotient (53 >= 2 x 24 + 2 bits), the clamp at ±448 commutes with that rounding,
    and torch casts float64 to float8_e4m3fn through float32."""
    work = torch.float32 if _e4m3_in_float32(groups, scale, args) else torch.float64
    scaled = groups.to(work, copy=True).div_(scale.to(work).unsqueeze(-1))
    shift = None if zero is None else zero.to(torch.float64).unsqueeze(-1)
    return to_code_grid_(scaled, shift, args).to(FP8_DTYPE if args.type == "float" else torch.int8)


# dtypes whose every value float32 holds exactly
FLOAT32_EXACT = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def _e4m3_in_float32(groups: Tensor, scale: Tensor, args: QuantArgs) -> bool:
    return (
        args.type == "float"
        and args.num_bits == 8
        and groups.dtype in FLOAT32_EXACT
        and scale.dtype in FLOAT32_EXACT
    )


def to_code_grid_(scaled: Tensor, zero: Tensor | None, args: QuantArgs) -> Tensor:
    """Weights divided by their scale (float64) -> codes, in place: the zero point added, then
    rounded and clamped to the integer range; float codes saturated (and E2M1 ones rounded:
    the cast to FP8 rounds E4M3 ones). The one rounding rule of RTN, GPTQ and the scan."""
    if args.type == "float":
        return to_float_grid_(scaled, args)
    if zero is not None:
        scaled.add_(zero)
    return scaled.round_().clamp_(*int_range(args.num_bits))


def dequantize(
    codes: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    args: QuantArgs,
    global_scale: Tensor | None = None,
) -> Tensor:
    """Float32 values of `codes` [rows, cols] under `args` (the inverse of `quantize_weight`)."""
    groups = as_groups(codes, args)
    shape = (groups.shape[0], groups.shape[1], 1)
    scale = expand_block_scale(effective_scale(scale, global_scale), args, codes.shape[0])
    zero_g = None if zero is None else zero.reshape(shape)
    return scale_codes(groups, scale.reshape(shape), zero_g).reshape(codes.shape)


def scale_codes(
    codes: Tensor, scale: Tensor, zero: Tensor | None, *, dtype: torch.dtype = ACCUM_DTYPE
) -> Tensor:
    """(code - zero) · scale in `dtype`, scale and zero broadcast against the codes: the one
    dequantization formula (groups, GPTQ's single columns, g_idx-indexed checkpoints)."""
    values = codes.to(dtype, copy=True)  # worked on in place, never the caller's tensor
    if zero is not None:
        values.sub_(zero.to(dtype))
    return values.mul_(scale.to(dtype))


def group_ranges(groups: Tensor) -> tuple[Tensor, Tensor]:
    """Each group's min and max [rows, groups] of `groups` [rows, groups, n], in float64."""
    return groups.amin(dim=-1).to(torch.float64), groups.amax(dim=-1).to(torch.float64)


def clipped_qparams(
    ranges: tuple[Tensor, Tensor],
    args: QuantArgs,
    scale_dtype: torch.dtype,
    clip_ratio: Tensor | float = 1.0,
    global_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Scale and zero point ([blocks, groups]) of the group `ranges` shrunk by `clip_ratio`
    (a number, or one ratio per group): RTN's and the clipping search's one rule."""
    low, high = ranges
    ratio = torch.as_tensor(clip_ratio, dtype=torch.float64, device=low.device)
    min_vals = rows_per_block(low * ratio, args, torch.amin)
    max_vals = rows_per_block(high * ratio, args, torch.amax)
    return choose_qparams(
        min_vals, max_vals, args, scale_dtype=scale_dtype, global_scale=global_scale
    )


def weight_global_scale(weight: Tensor, args: QuantArgs) -> Tensor | None:
    """NVFP4's global scale of `weight` (from its absmax), None for the other formats."""
    if args.strategy != "tensor_group":
        return None
    return nvfp4_global_scale(weight.abs().amax().to(torch.float64).cpu()).to(weight.device)


def quantize_weight(
    weight: Tensor,
    args: QuantArgs,
    *,
    scale_dtype: torch.dtype | None = None,
    clip_ratio: Tensor | float = 1.0,
) -> QuantizedWeight:
    """Round-to-nearest quantization of weight [out, in].

    clip_ratio shrinks each group's range before choosing qparams (1.0: min/max; a tensor of
    shape [out, groups] holds a ratio per group, as found by the MSE clipping search).
    """
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    scale_dtype = scale_dtype or (weight.dtype if weight.is_floating_point() else ACCUM_DTYPE)
    groups = as_groups(weight, args)
    global_scale = weight_global_scale(weight, args)
    scale, zero = clipped_qparams(group_ranges(groups), args, scale_dtype, clip_ratio, global_scale)
    coded_scale = scale if global_scale is None else effective_scale(scale, global_scale)
    row_scale = expand_block_scale(coded_scale, args, weight.shape[0])
    codes = quantize_grouped(groups, row_scale, zero, args).reshape(weight.shape)
    return QuantizedWeight(
        codes=codes,
        scale=_stored_shape(scale, args),
        zero_point=None if zero is None else _stored_shape(zero, args),
        args=args,
        global_scale=global_scale,
    )


def fake_quantize(x: Tensor, args: QuantArgs, scale: Tensor | None = None) -> Tensor:
    """Quantize-dequantize activations x [..., hidden] as a kernel would: per token (or token
    group) from their own range when `args` is dynamic, else with the calibrated `scale`; NVFP4
    inputs: per group of 16 under the calibrated global scale `scale`.

    Computed in float32, as activation quantization kernels compute (and fast enough to run on
    every calibration and evaluation token). Rows that are all zero get scale eps and come back
    as zeros, never NaN.
    """
    rows = x.reshape(-1, x.shape[-1]).to(ACCUM_DTYPE)
    if not args.symmetric:  # other tools' checkpoints only: the general path
        q = quantize_weight(rows, args, scale_dtype=ACCUM_DTYPE)
        return q.dequantize(ACCUM_DTYPE).to(x.dtype).reshape(x.shape)
    if scale is None or args.dynamic == "local":
        groups = as_groups(rows, args)
        # max|x| rather than max(-min, max): the same value, and abs + amax is about 7x faster
        # on a CPU than aminmax over the last dimension (2 passes of a W8A8 layer's inputs).
        scale = _dynamic_scale(groups.abs().amax(dim=-1, keepdim=True), args, scale)
    else:
        groups = rows.reshape(1, 1, -1)
        scale = scale.to(device=x.device, dtype=ACCUM_DTYPE).reshape(1, 1, 1)
    scaled = groups / scale
    if args.type == "float":
        codes = to_float_grid_(scaled, args).to(FP8_DTYPE).to(ACCUM_DTYPE)
    else:
        codes = scaled.round_().clamp_(*int_range(args.num_bits))
    return codes.mul_(scale).reshape(x.shape).to(x.dtype)


def _dynamic_scale(absmax: Tensor, args: QuantArgs, global_scale: Tensor | None) -> Tensor:
    """The run-time scales (float32) of groups of inputs whose extremes are `absmax`."""
    if args.microscaled:  # the format's own scales: E8M0, or E4M3 under the global scale
        stored, _ = choose_qparams(
            -absmax, absmax, args, scale_dtype=ACCUM_DTYPE, global_scale=global_scale
        )
        return effective_scale(stored, global_scale)
    scale = absmax.div_(code_max(args))
    return torch.where(scale == 0, torch.finfo(ACCUM_DTYPE).eps, scale)


def code_max(args: QuantArgs) -> float:
    """The largest code: 448 for FP8 E4M3, 6 for FP4 E2M1, 2**(bits-1) - 1 for integers (127:
    the scale the int8 kernels use, absmax / 127)."""
    return float_code_max(args) if args.type == "float" else float(int_range(args.num_bits)[1])


def static_scale(
    absmax: Tensor | float, args: QuantArgs, scale_dtype: torch.dtype = ACCUM_DTYPE
) -> Tensor:
    """The per-tensor scale [1] stored for inputs of range ±absmax: absmax / qmax (127 for int8,
    as the int8 kernels divide; 448 for FP8), rounded to its storage dtype; for NVFP4 inputs,
    their float32 global scale."""
    if args.strategy == "tensor_group":
        return nvfp4_global_scale(torch.as_tensor(absmax, dtype=torch.float64).cpu())
    scale = torch.as_tensor(absmax, dtype=torch.float64).reshape(1).cpu() / code_max(args)
    return _storable(scale, scale_dtype)
