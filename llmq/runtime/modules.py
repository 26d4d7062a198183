"""Quantized linears for inference: packed weights as buffers, forward through the llmq custom ops
(Triton on a GPU, the torch reference on the CPU)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmq.kernels import ops  # also registers torch.ops.llmq.*, which torch.compile traces
from llmq.kernels.reference import dequantize_int4
from llmq.pack.layout import FP8_CODES, W4A16Weight, W8A8Weight


class QuantizedLinear(nn.Module):
    """Common part: input flattening, bias, and which implementation the op runs."""

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None, triton: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.triton = triton
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: Tensor) -> Tensor:
        """x [M, K] @ W^T through the kernel (no bias)."""
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype) -> Tensor:
        """W [N, K] in `dtype`: the dense baseline `llmq bench` compares with."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """The kernel and scheme, e.g. "w4a16 g128" or "w8a8 fp8"."""
        raise NotImplementedError

    @property
    def packed_bytes(self) -> int:
        """Bytes of weight data the kernel reads per call (codes, scales, zero points)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            "kernel=triton" if self.triton else "kernel=torch"
        )


class W4A16Linear(QuantizedLinear):
    def __init__(self, weight: W4A16Weight, bias: Tensor | None = None, *, triton: bool) -> None:
        super().__init__(weight.in_features, weight.out_features, bias, triton)
        self.group_size = weight.group_size
        self.fp4 = weight.fp4
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("zero", weight.zero)
        self.register_buffer("g_idx", weight.g_idx)

    def matmul(self, x: Tensor) -> Tensor:
        op = torch.ops.llmq.w4a16_linear if torch.compiler.is_compiling() else ops.w4a16_product
        return op(
            x, self.packed, self.scale, self.zero, self.g_idx,
            self.in_features, self.group_size, self.triton, self.fp4,
        )  # fmt: skip

    @property
    def layout(self) -> W4A16Weight:
        """The packed weight as the kernels take it (benchmarks call them with a config)."""
        return W4A16Weight(
            self.packed, self.scale, self.zero, self.g_idx, self.in_features, self.group_size,
            self.fp4,
        )  # fmt: skip

    def dequantized_weight(self, dtype: torch.dtype) -> Tensor:
        return dequantize_int4(self.layout).to(dtype)

    @property
    def label(self) -> str:
        if self.fp4:
            return f"fp4 g{self.group_size}"
        return f"w4a16 g{self.group_size}{'' if self.zero is None else ' asym'}"


class W8A8Linear(QuantizedLinear):
    """W8A8-INT8 or FP8 (by the codes' dtype), activations quantized per token inside the op."""

    def __init__(self, weight: W8A8Weight, bias: Tensor | None = None, *, triton: bool) -> None:
        super().__init__(weight.in_features, weight.out_features, bias, triton)
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("input_scale", weight.input_scale)

    def matmul(self, x: Tensor) -> Tensor:
        op = torch.ops.llmq.w8a8_linear if torch.compiler.is_compiling() else ops.w8a8_product
        return op(x, self.codes, self.scale, self.input_scale, self.triton)

    @property
    def layout(self) -> W8A8Weight:
        """The 8-bit weight as the kernels take it (benchmarks call them with a config)."""
        return W8A8Weight(self.codes, self.scale, self.input_scale)

    def dequantized_weight(self, dtype: torch.dtype) -> Tensor:
        return (self.codes.float() * self.scale[:, None]).to(dtype)

    @property
    def label(self) -> str:
        kind = "w8a8 fp8" if self.codes.dtype == FP8_CODES else "w8a8 int8"
        return kind if self.input_scale is None else f"{kind} static"
