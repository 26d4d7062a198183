"""FP8 block releases (DeepSeek-V3 and R1, Kimi K2, Qwen3's FP8 checkpoints...), read as the
bfloat16 checkpoints they stand for.

Their config.json says `quant_method: fp8` with a `weight_block_size` ([128, 128]); each
quantized linear stores `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32
[ceil(out / 128), ceil(in / 128)]: the factor by which each block's codes are multiplied
(DeepSeek's name for it). llmq shows each such weight as bfloat16, the code times its block's
factor in float32 rounded once, as DeepSeek's own fp8_cast_bf16 conversion writes it, hides the
factors, and drops the quantization_config: every command then reads the release as that
bfloat16 checkpoint, with no converted copy on disk (1.3 TB for DeepSeek-V3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from llmq.errors import InputError
from llmq.io.views import ShownTensors, StoredReader

if TYPE_CHECKING:
    from torch import Tensor

FACTORS = "_scale_inv"  # `weight_scale_inv`, beside `weight`
_CODES_DTYPE = "F8_E4M3"


@dataclass(frozen=True, slots=True)
class Fp8BlockWeight:
    """A bfloat16 weight stored as FP8 codes and one factor per block."""

    codes: str  # e.g. model.layers.0.mlp.up_proj.weight
    block: tuple[int, int]  # rows, columns

    def read(self, stored: StoredReader) -> Tensor:
        import torch

        codes = stored(self.codes).float()
        factors = stored(self.codes + FACTORS).float()
        rows, columns = self.block
        per_value = factors.repeat_interleave(rows, 0).repeat_interleave(columns, 1)
        return (codes * per_value[: codes.shape[0], : codes.shape[1]]).to(torch.bfloat16)


def fp8_block_size(config: dict[str, Any]) -> tuple[int, int] | None:
    """The block of an FP8 block release's config; None for any other checkpoint."""
    quantization = config.get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    if quantization.get("quant_method") != "fp8" or block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):  # fmt: skip
        raise InputError(f"config.json: quantization_config.weight_block_size {block!r} is not two positive integers")  # fmt: skip
    return block[0], block[1]


def show_bfloat16(tensors: ShownTensors, config: dict[str, Any]) -> dict[str, Any]:
    """Show an FP8 block release's weights as bfloat16 (in place); the config without its
    quantization_config. Any other checkpoint's config is returned as it is."""
    block = fp8_block_size(config)
    if block is None:
        return config
    shown = tensors.shown
    for name, info in list(shown.items()):
        if info.dtype != _CODES_DTYPE or name + FACTORS not in shown:
            continue
        rows, columns = block
        expected = (-(-info.shape[0] // rows), -(-info.shape[1] // columns))
        if shown[name + FACTORS].shape != expected:
            raise InputError(
                f"{info.shard}: {name}{FACTORS} is {list(shown[name + FACTORS].shape)}; blocks of {rows} x "
                f"{columns} over {list(info.shape)} need {list(expected)}"
            )
        tensors.hide({name, name + FACTORS})
        shown[name] = replace(info, dtype="BF16")
        tensors.views[name] = Fp8BlockWeight(name, block)
    return {key: value for key, value in config.items() if key != "quantization_config"}
