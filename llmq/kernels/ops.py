"""The kernels as torch custom ops (`torch.ops.llmq.*`), so that quantized linears compose with
torch.compile and CUDA graphs: each op has a fake (meta) implementation giving the output's
shape and dtype without running anything.

Each op runs the Triton kernel when asked to (`triton=True`: on a GPU, or on the CPU under
TRITON_INTERPRET=1), else the torch reference of the same math. Triton is imported only then,
so the reference path works where Triton does not install.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmq.errors import InputError
from llmq.kernels import reference
from llmq.kernels.support import interpreting, triton_installed
from llmq.pack.layout import W4A16Weight, W8A8Weight


def check_triton_usable(device: torch.device) -> None:
    """Raise a clear error when Triton kernels cannot run on `device`."""
    if not triton_installed():
        raise InputError("Triton is not installed", hint="pip install triton (Linux)")
    if device.type == "cpu" and not interpreting():
        raise InputError(
            "Triton kernels on the CPU need its interpreter",
            hint="set TRITON_INTERPRET=1, or use the torch reference kernels",
        )


def w4a16_product(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    g_idx: Tensor | None,
    in_features: int,
    group_size: int,
    triton: bool,
    fp4: bool = False,
) -> Tensor:
    """x [M, K] @ W^T for a packed int4 (or FP4) weight (see llmq.pack.layout.W4A16Weight).
    Eager code calls this directly: the custom op's dispatch costs more than a small kernel's
    launch."""
    weight = W4A16Weight(packed, scale, zero, g_idx, in_features, group_size, fp4)
    if triton:
        from llmq.kernels.w4a16 import w4a16_matmul

        return w4a16_matmul(x, weight)
    return reference.w4a16_linear(x, weight)


w4a16_linear = torch.library.custom_op("llmq::w4a16_linear", mutates_args=())(w4a16_product)


@w4a16_linear.register_fake
def _(x, packed, scale, zero, g_idx, in_features, group_size, triton, fp4=False):
    return x.new_empty(x.shape[0], packed.shape[0])


def w8a8_product(
    x: Tensor, codes: Tensor, scale: Tensor, input_scale: Tensor | None, triton: bool
) -> Tensor:
    """quantize(x) [M, K] @ W^T with both scales: int8 or float8_e4m3fn codes [N, K];
    activations per token, or with the static input_scale when given (eager code calls this
    directly, as `w4a16_product`)."""
    weight = W8A8Weight(codes, scale, input_scale)
    if triton:
        from llmq.kernels.w8a8 import w8a8_matmul

        return w8a8_matmul(x, weight)
    return reference.w8a8_linear(x, weight)


w8a8_linear = torch.library.custom_op("llmq::w8a8_linear", mutates_args=())(w8a8_product)


@w8a8_linear.register_fake
def _(x, codes, scale, input_scale, triton):
    return x.new_empty(x.shape[0], codes.shape[0])
