"""The bytes a linear takes on disk, exactly as `pack.format.compress` writes it: what a budget
of stored bits is counted in (mixed precision), computed before any weight is quantized."""

from __future__ import annotations

import math

import torch

from llmq.config import QuantArgs

WORD_BYTES = 4  # pack-quantized codes and zero points: int32 words
SHAPE_BYTES = 2 * 8  # weight_shape: [rows, columns] in int64


def stored_bytes(args: QuantArgs | None, rows: int, columns: int, dtype: torch.dtype) -> int:
    """A [rows, columns] linear's tensors in the pack-quantized format (integer codes packed
    into int32 words, scales in the weight's `dtype`, zero points packed along the rows, and
    `weight_shape`), or its weight as stored (`args` None: kept dense)."""
    if args is None:
        return rows * columns * dtype.itemsize
    if args.type != "int" or args.scale_dtype is not None:
        raise ValueError(f"{args.label}: not a pack-quantized integer format")
    codes = rows * math.ceil(columns * args.num_bits / 32) * WORD_BYTES
    if args.strategy == "group":
        groups = math.ceil(columns / int(args.group_size or columns))
    elif args.strategy == "channel":
        groups = 1
    else:
        raise ValueError(f"{args.label}: strategy {args.strategy} is not counted")
    scales = rows * groups * dtype.itemsize
    zeros = 0 if args.symmetric else math.ceil(rows * args.num_bits / 32) * groups * WORD_BYTES
    return codes + scales + zeros + SHAPE_BYTES
