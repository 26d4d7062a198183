"""The bytes a linear takes on disk, exactly as `pack.format.compress` writes it: what a budget
of stored bits is counted in (mixed precision), computed before any weight is quantized."""

from __future__ import annotations

import math

import torch

from llmq.config import QuantArgs

WORD_BYTES = 4  # pack-quantized codes and zero points: int32 words
SHAPE_BYTES = 2 * 8  # weight_shape: [rows, columns] in int64


def stored_bytes(args: QuantArgs | None, rows: int, columns: int, dtype: torch.dtype) -> int:
    """A [rows, columns] linear's tensors as `compress` writes them for `args`, or its weight as
    stored (`args` None: kept dense). Integer codes: pack-quantized (packed into int32 words,
    scales in the weight's `dtype`, zero points packed along the rows, and `weight_shape`);
    float codes: FP8 one a byte, FP4 two, scales in their storage dtype (E4M3 or E8M0: a byte;
    else the weight's dtype), NVFP4's float32 global scale."""
    if args is None:
        return rows * columns * dtype.itemsize
    groups = _groups(args, columns)
    if args.type == "float":
        codes = rows * math.ceil(columns * args.num_bits / 8)
        scale_bytes = 1 if args.scale_dtype is not None else dtype.itemsize
        global_scale = 4 if args.strategy == "tensor_group" else 0
        return codes + rows * groups * scale_bytes + global_scale
    if args.scale_dtype is not None:
        raise ValueError(f"{args.label}: not a pack-quantized integer format")
    codes = rows * math.ceil(columns * args.num_bits / 32) * WORD_BYTES
    scales = rows * groups * dtype.itemsize
    zeros = 0 if args.symmetric else math.ceil(rows * args.num_bits / 32) * groups * WORD_BYTES
    return codes + scales + zeros + SHAPE_BYTES


def _groups(args: QuantArgs, columns: int) -> int:
    """Scales a row holds."""
    if args.strategy in ("group", "tensor_group"):
        return math.ceil(columns / int(args.group_size or columns))
    if args.strategy == "channel":
        return 1
    raise ValueError(f"{args.label}: strategy {args.strategy} is not counted")
