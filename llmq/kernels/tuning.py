"""Launch configs measured on a GPU, consulted before each kernel's built-in rule.

`benchmarks/tune_kernels.py` times candidate tile configs of every kernel on a GPU over Llama-3
layer shapes and keeps, for each kernel and M bucket, the candidate with the best geometric mean
over the shapes. Such a table ships per GPU model as `llmq/kernels/tuned/<gpu>.json` (the
device's name in lowercase, runs of other characters as '-', e.g. `nvidia-h200.json`) and is
found by the device's name; `LLMQ_KERNEL_TUNING=path` names another table (how a tuning run
checks its own table before it is committed). Without a table the built-in rules apply.

K splits are stored as `waves`, programs per SM, not as a factor: the factor that fills the GPU
depends on the shape (N) and the SM count, the target does not.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from llmq.errors import InputError
from llmq.kernels.support import Path as KernelPath
from llmq.kernels.support import TileConfig, split_for

Kernel = Literal["w4a16", "w8a8_int8", "w8a8_fp8"]
KERNELS: tuple[Kernel, ...] = ("w4a16", "w8a8_int8", "w8a8_fp8")
M_BUCKETS = (1, 16, 64, 256, 1024, 4096)  # a product of M rows takes the first bucket >= M
TUNED_DIR = Path(__file__).with_name("tuned")
TUNING_ENV = "LLMQ_KERNEL_TUNING"


@dataclass(frozen=True, slots=True)
class TunedConfig:
    """A tile config independent of the shape: `waves` programs per SM decide the K split."""

    path: KernelPath
    block_m: int
    block_n: int
    block_k: int
    waves: float = 0.0  # 0: no split
    num_warps: int = 4
    num_stages: int = 3

    def resolve(
        self, m: int, n: int, k: int, device: torch.device, max_block_k: int | None = None
    ) -> TileConfig:
        """The launch for one [m, k] x [n, k]^T product; block_k capped at `max_block_k` (a
        W4A16 K tile must not straddle quantization groups)."""
        block_k = min(self.block_k, max_block_k or self.block_k)
        waves = 0.0 if self.path == "dequant" else self.waves
        split = split_for(waves, m, n, k, self.block_m, self.block_n, block_k, device)
        return TileConfig(
            self.path, self.block_m, self.block_n, block_k, split_k=split,
            num_warps=self.num_warps, num_stages=self.num_stages,
        )  # fmt: skip


def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def table_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def table_path(device: torch.device) -> Path | None:
    """The table for `device`: $LLMQ_KERNEL_TUNING, else the shipped one for its GPU model."""
    if os.environ.get(TUNING_ENV):
        return Path(os.environ[TUNING_ENV])
    if device.type != "cuda":
        return None
    return _shipped_table(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _shipped_table(device_index: int) -> Path | None:
    """Looked up once per GPU: every launch asks."""
    shipped = TUNED_DIR / f"{table_name(torch.cuda.get_device_name(device_index))}.json"
    return shipped if shipped.is_file() else None


@functools.cache
def load_table(path: Path) -> dict[str, dict[int, TunedConfig]]:
    """{kernel: {M bucket: config}} from a table file written by benchmarks/tune_kernels.py."""
    try:
        data = json.loads(path.read_text())
        return {
            kernel: {int(bucket): TunedConfig(**fields) for bucket, fields in by_m.items()}
            for kernel, by_m in data["kernels"].items()
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: not a kernel tuning table ({exc})") from None


def tuned_config(
    kernel: Kernel, m: int, n: int, k: int, device: torch.device, max_block_k: int | None = None
) -> TileConfig | None:
    """The measured launch for this product, or None when no table covers it."""
    path = table_path(device)
    if path is None:
        return None
    tuned = load_table(path).get(kernel, {}).get(m_bucket(m))
    return None if tuned is None else tuned.resolve(m, n, k, device, max_block_k)


def table_json(configs: dict[str, dict[int, TunedConfig]], **about: object) -> str:
    """The file load_table reads, with `about` (GPU, versions, command, date) kept beside."""
    kernels = {
        kernel: {str(bucket): asdict(config) for bucket, config in sorted(by_m.items())}
        for kernel, by_m in configs.items()
    }
    return json.dumps({**about, "kernels": kernels}, indent=1) + "\n"
