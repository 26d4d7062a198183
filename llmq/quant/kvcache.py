"""KV cache quantization: one static scale for a layer's keys and one for its values, as
compressed-tensors' `kv_cache_scheme` and vLLM's `k_scale` / `v_scale` specify. Keys are
observed after the rotary embedding, which is what the cache holds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from llmq.config import QuantArgs
from llmq.quant.primitives import ACCUM_DTYPE, fake_quantize, static_scale

KV_SCALE_NAMES = ("k_scale", "v_scale")


@dataclass(slots=True)
class KVRange:
    """A KV hook that records the largest |key| and |value| and changes nothing."""

    key_absmax: Tensor = field(default_factory=lambda: torch.zeros((), dtype=ACCUM_DTYPE))
    value_absmax: Tensor = field(default_factory=lambda: torch.zeros((), dtype=ACCUM_DTYPE))

    def __call__(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.key_absmax = torch.maximum(self.key_absmax, key.detach().abs().amax().cpu().float())
        self.value_absmax = torch.maximum(
            self.value_absmax, value.detach().abs().amax().cpu().float()
        )
        return key, value

    def scales(self, args: QuantArgs, scale_dtype: torch.dtype) -> dict[str, Tensor]:
        """{"k_scale": [1], "v_scale": [1]}: absmax / qmax in the storage dtype."""
        return {
            "k_scale": static_scale(self.key_absmax, args, scale_dtype),
            "v_scale": static_scale(self.value_absmax, args, scale_dtype),
        }


@dataclass(frozen=True, slots=True)
class KVQuantizer:
    """A KV hook that quantize-dequantizes keys and values with their stored scales."""

    args: QuantArgs
    k_scale: Tensor
    v_scale: Tensor

    def __call__(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return (
            fake_quantize(key, self.args, self.k_scale.to(key.device)),
            fake_quantize(value, self.args, self.v_scale.to(value.device)),
        )
