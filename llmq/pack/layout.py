"""What the GEMM kernels read: one quantized linear's tensors, in the layout the kernels expect.

These are compressed-tensors' on-disk tensors with cheap load-time changes (a few bytes per
output row, measured by `llmq bench`): asymmetric zero points are unpacked from int32 words to
int8 [out, groups], and per-tensor weight scales are broadcast to one float32 scale per output
channel. For the Triton kernels the packed int4 words are also stored K-major (one transpose on
the device, `W4A16Weight.k_major`); values and shapes stay those of the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

FP8_CODES = torch.float8_e4m3fn
INT4_PER_WORD = 8  # codes per int32 word, low bits first; stored code = value + 8
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # an FP4 nibble's low 3 bits index these


@dataclass(frozen=True, slots=True)
class W4A16Weight:
    """A W4A16 weight [out, in]: compressed-tensors pack-quantized, 4 bits.

    packed: int32 [out, ceil(in / 8)]; code k of row n sits in bits 4*(k % 8) .. 4*(k % 8) + 3 of
        word packed[n, k // 8], as value + 8 (so -8..7 is stored as 0..15).
    scale: float16 / bfloat16 / float32 [out, groups]; group g covers inputs [g*G, (g+1)*G)
        (the last group may be partial), or the inputs whose g_idx is g.
    zero: int8 [out, groups] (asymmetric only): w = (code - zero) * scale.
    g_idx: int32 [in] (act-order checkpoints only): the group of each input column.
    group_size: G; `in_features` for per-channel weights.
    fp4: the codes are FP4 E2M1 (NVFP4, MXFP4 weights): a nibble is sign << 3 | the index of
        its magnitude in 0, 0.5, 1, 1.5, 2, 3, 4, 6. The format's bytes (two codes each, the
        even column low) read as little-endian int32 words put the nibbles where int4 puts them;
        scale is then the effective one (NVFP4: E4M3 scale / global; MX: the power of two).
    """

    packed: Tensor
    scale: Tensor
    zero: Tensor | None
    g_idx: Tensor | None
    in_features: int
    group_size: int
    fp4: bool = False

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def k_major(self) -> W4A16Weight:
        """The same weight with its packed words stored K-major ([in / 8, out] in memory, still
        indexed [out, in / 8] through strides). The Triton kernels read a tile's words for
        consecutive outputs in one coalesced load then: on an H100, 1.11-1.42x faster at M = 16,
        1.16-1.52x at M = 64, 0.94-1.17x at M = 1 over 8 Llama-3 shapes (benchmarks/RESULTS.md,
        issue 38). The file keeps compressed-tensors' row-major layout; this runs once, at load,
        for the Triton kernels only."""
        return dataclasses.replace(self, packed=self.packed.t().contiguous().t())

    def to(self, device: torch.device | str, scale_dtype: torch.dtype) -> W4A16Weight:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return W4A16Weight(
            packed=self.packed.to(device),
            scale=self.scale.to(device=device, dtype=scale_dtype),
            zero=move(self.zero),
            g_idx=move(self.g_idx),
            in_features=self.in_features,
            group_size=self.group_size,
            fp4=self.fp4,
        )


@dataclass(frozen=True, slots=True)
class W8A8Weight:
    """A W8A8 weight [out, in]: int8 codes (int-quantized) or float8_e4m3fn codes
    (float-quantized), symmetric, one float32 scale per output channel: w = code * scale[n].
    Activations are quantized at run time to the same code type: per token from their own range,
    or, when `input_scale` (float32 [1], calibrated; compressed-tensors' static input_scale) is
    given, with that one scale."""

    codes: Tensor
    scale: Tensor  # float32 [out]
    input_scale: Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.codes.dtype == FP8_CODES

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def to(self, device: torch.device | str) -> W8A8Weight:
        static = None if self.input_scale is None else self.input_scale.to(device)
        return W8A8Weight(self.codes.to(device), self.scale.to(device), static)
