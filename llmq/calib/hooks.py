"""Hooks on a layer's linears: observe their inputs (calibration statistics) or replace them
(activations fake-quantized as a checkpoint's scheme says, for the quantized pass and eval)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from llmq.config import QuantArgs
from llmq.quant.primitives import fake_quantize


@contextmanager
def input_hooks(
    layer: nn.Module, names: list[str], hook: Callable[[str, Tensor], Tensor | None]
) -> Iterator[None]:
    """Call `hook(name, input)` before each named linear of `layer`; a returned tensor replaces
    the input (activation fake quantization), None leaves it (observation)."""

    def make(name: str) -> Callable[[nn.Module, tuple[Tensor, ...]], Any]:
        def pre_hook(_module: nn.Module, args: tuple[Tensor, ...]) -> Any:
            replaced = hook(name, args[0])
            return None if replaced is None else (replaced, *args[1:])

        return pre_hook

    handles = [layer.get_submodule(name).register_forward_pre_hook(make(name)) for name in names]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


InputQuantization = tuple[QuantArgs, Tensor | None]
"""How a linear's input is quantized: its arguments and, for static ones, the stored scale."""


@contextmanager
def activation_quantization(
    layer: nn.Module, inputs: dict[str, InputQuantization]
) -> Iterator[None]:
    """Fake-quantize the inputs of the given linears while the context is open: per token
    (or token group) when dynamic, with the stored scale when static.

    Linears that read the same tensor with the same arguments (q/k/v, gate/up) share one
    quantize-dequantize: it is a third of a W8A8 pass's cost, computed once instead of thrice.
    """
    current: list[Tensor] = []  # the input the results below belong to
    results: list[tuple[InputQuantization, Tensor]] = []

    def quantize(name: str, x: Tensor) -> Tensor:
        spec = inputs[name]
        if not current or current[0] is not x:
            current[:], results[:] = [x], []
        for done, output in results:
            if _same_quantization(done, spec):
                return output
        output = fake_quantize(x, *spec)
        results.append((spec, output))
        return output

    with input_hooks(layer, list(inputs), quantize):
        try:
            yield
        finally:
            current.clear()
            results.clear()


def _same_quantization(a: InputQuantization, b: InputQuantization) -> bool:
    """The same arguments and the same static scale (or both dynamic)."""
    (args_a, scale_a), (args_b, scale_b) = a, b
    if args_a != args_b or (scale_a is None) != (scale_b is None):
        return False
    return scale_a is None or bool(torch.equal(scale_a, scale_b))
