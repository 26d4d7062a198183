"""Real activations: layer 0 of the default model on a few pydoc calibration windows; GPTQ run
with a chosen column loop."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from torch import Tensor

from llmq.quant import gptq

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the FP4 magnitudes, by index


def nearest_e2m1(x: float) -> float:
    """Float64 reference: the nearest E2M1 magnitude after saturating at 6, a tie going to the
    even mantissa (the even index of E2M1), with the sign of x (also on zero)."""
    magnitude = min(abs(x), 6.0)
    best = min(range(8), key=lambda i: (abs(magnitude - E2M1[i]), i % 2))
    return math.copysign(E2M1[best], x)


REAL_LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


@pytest.fixture(scope="session")
def real_observed(default_model: Path) -> tuple[dict[str, Tensor], ...]:
    from llmq.calib.collect import run_observed
    from llmq.calib.data import calibration_windows
    from llmq.calib.stream import LayerStream
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.io.checkpoint import open_checkpoint

    stream = LayerStream(open_checkpoint(default_model), device="cpu")
    windows = calibration_windows(
        load_tokenizer(default_model), "pydoc", num_samples=8, seq_len=256, seed=0
    )
    layer = stream.load_layer(0)
    _, stats = run_observed(
        stream, layer, list(REAL_LINEARS), stream.embed(windows.input_ids), hessian=True
    )
    weights = {name: layer.get_submodule(name).weight.data for name in REAL_LINEARS}
    hessians = {name: stats[name].hessian for name in REAL_LINEARS}
    return weights, hessians, {name: stats[name].mean_abs for name in REAL_LINEARS}


@pytest.fixture(scope="session")
def real_weights(real_observed: tuple[dict[str, Tensor], ...]) -> dict[str, Tensor]:
    return real_observed[0]


@pytest.fixture(scope="session")
def real_hessians(real_observed: tuple[dict[str, Tensor], ...]) -> dict[str, Tensor]:
    return real_observed[1]


@pytest.fixture(scope="session")
def real_mean_abs(real_observed: tuple[dict[str, Tensor], ...]) -> dict[str, Tensor]:
    return real_observed[2]


def run_gptq(
    monkeypatch: pytest.MonkeyPatch, loop: str, *args: Any, **kwargs: Any
) -> gptq.GPTQResult:
    """gptq_quantize_weight with the column loop named: "compiled" (checked to be the one that
    ran), "torch", or "triton" (the GPU kernel, here in Triton's interpreter)."""
    calls = []
    compiled = gptq.quantize_columns
    with monkeypatch.context() as patch:
        patch.setattr(gptq, "quantize_columns", lambda *a: calls.append(1) or compiled(*a))
        if loop == "torch":
            patch.setattr(gptq, "compiled_loop_applies", lambda *_: False)
        if loop == "triton":
            from llmq.quant.gptq_triton import quantize_columns_gpu

            patch.setattr(gptq, "_gpu_column_loop", lambda *_: quantize_columns_gpu)
        result = gptq.gptq_quantize_weight(*args, **kwargs)
    assert bool(calls) == (loop == "compiled")
    return result
