"""Where the Triton kernels can run, and the two things that differ under Triton's CPU interpreter.

`TRITON_INTERPRET=1` runs the kernels on CPU tensors, which is how CI tests them. The interpreter
multiplies bfloat16 `tl.dot` operands as raw bits (wrong in every Triton version seen), so under
it bfloat16 tiles are upcast to float32 before the dot; compiled kernels keep bfloat16.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from llmq.errors import InputError


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that 16-bit tiles are multiplied in: their own, but float32 for bfloat16 in the
    interpreter."""
    if dtype == torch.bfloat16 and interpreting():
        return torch.float32
    return dtype


def check_matrix(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...], ndim: int = 2) -> None:
    """Raise a clear error (never an assert) when a kernel argument has the wrong rank or dtype."""
    if t.ndim != ndim:
        raise InputError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise InputError(
            f"{name}: dtype {str(t.dtype).removeprefix('torch.')} (expected {allowed})"
        )


def check_same_device(**tensors: Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise InputError(f"kernel arguments on different devices: {listing}")


Path = Literal["decode", "tiled", "dequant"]
DECODE_MAX_M = 16  # up to here a product is a weight stream: split K across the SMs


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One kernel launch: the path taken and its tile sizes."""

    path: Path
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python: `triton.cdiv` is a JIT builtin in Triton 3.6 and costs
    several microseconds a call, paid on every launch of a batch-1 decode."""
    return -(-a // b)


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small grids keep CPU tests fast


DECODE_WAVES = 2  # the built-in rule: split K until there are about two programs per SM


def split_for(
    waves: float, m: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
    device: torch.device,
) -> int:  # fmt: skip
    """The K split giving about `waves` programs per SM over the output tiles (a thin product's
    single row of tiles would leave most SMs idle), never more shares than K tiles; 1 when
    waves is 0."""
    if waves <= 0:
        return 1
    output_tiles = -(-m // block_m) * -(-n // block_n)
    k_tiles = -(-k // block_k)
    return max(1, min(k_tiles, round(waves * sm_count(device) / output_tiles)))


def launch_stages(config: TileConfig) -> int:
    """Software-pipelining depth: the config's, but 1 in the interpreter (which ignores it)."""
    return 1 if interpreting() else config.num_stages
