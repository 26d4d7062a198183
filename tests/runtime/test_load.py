"""`load_quantized`: checkpoints written by `llmq quantize` run on llmq's kernels and compute
what the dequantized reference model computes; schemes without a kernel are refused clearly."""

from __future__ import annotations

import pytest
import torch

import llmq
from llmq.errors import InputError
from llmq.io.checkpoint import open_checkpoint
from llmq.runtime.load import load_dequantized, load_quantized
from llmq.runtime.modules import W4A16Linear, W8A8Linear

IDS = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym", "nvfp4a16", "mxfp4a16"])
def test_w4a16_matches_the_dequantized_model(tiny_quantized, scheme: str) -> None:
    """int4 and FP4 weights (NVFP4A16, MXFP4A16 decode E2M1 in the same kernel) compute what
    the dequantized reference computes."""
    ckpt = open_checkpoint(tiny_quantized(scheme))
    model = load_quantized(ckpt)
    linears = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    assert len(linears) == 2 * 7 and not any(m.triton for m in linears)
    assert (linears[0].zero is not None) == (scheme == "w4a16-asym")
    assert linears[0].fp4 == scheme.endswith("fp4a16")
    torch.testing.assert_close(logits(model), logits(load_dequantized(ckpt)), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("scheme", "activations"),
    [("w8a8", "dynamic"), ("fp8", "dynamic"), ("w8a8", "static"), ("fp8", "static")],
)
def test_w8a8_matches_the_simulation_llmq_eval_runs(tiny_quantized, scheme, activations) -> None:
    ckpt = open_checkpoint(tiny_quantized(scheme, clip="none", activations=activations))
    model = load_quantized(ckpt)
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(linears) == 2 * 7
    assert all((m.input_scale is not None) == (activations == "static") for m in linears)
    simulated = load_dequantized(ckpt, quantize_inputs=True)
    plain = load_dequantized(ckpt)
    ours = logits(model)
    torch.testing.assert_close(ours, logits(simulated), rtol=0, atol=2e-3)
    # the activation quantization is really there: without it the logits move much further
    assert (ours - logits(plain)).abs().max() > 10 * (ours - logits(simulated)).abs().max()


@pytest.mark.parametrize("scheme", ["w4a16-asym", "w8a8", "nvfp4a16"])
@pytest.mark.interpreter
def test_triton_kernels_run_the_model_in_the_interpreter(tiny_quantized, scheme: str) -> None:
    ckpt = open_checkpoint(tiny_quantized(scheme))
    triton = load_quantized(ckpt, kernels="triton")
    assert all(m.triton for m in triton.modules() if isinstance(m, (W4A16Linear, W8A8Linear)))
    # int4 words K-major for the kernels (one transpose at load), row-major as stored otherwise
    for kernels, contiguous in (("triton", False), ("torch", True)):
        model = triton if kernels == "triton" else load_quantized(ckpt, kernels=kernels)
        packed = [m.packed for m in model.modules() if isinstance(m, W4A16Linear)]
        assert all(p.is_contiguous() == contiguous for p in packed)
    torch.testing.assert_close(
        logits(triton), logits(load_quantized(ckpt, kernels="torch")), rtol=1e-3, atol=2e-3
    )


@pytest.mark.parametrize(
    ("scheme", "options", "fragment"),
    [
        ("w8a16", {}, "no llmq kernel for weights int8 channel, activations float"),
        ("fp8-block", {}, "no llmq kernel for weights fp8 block 128x128"),
        ("mxfp4", {}, "no llmq kernel for weights mxfp4 g32, activations mxfp4 g32 dynamic"),
        ("w8a8", {"kv_cache": "int8"}, "KV cache is quantized"),
    ],
)
def test_schemes_without_a_kernel_are_refused(tiny_quantized, scheme, options, fragment) -> None:
    path = tiny_quantized(scheme, **options)
    with pytest.raises(InputError, match=fragment):
        llmq.load_quantized(path)


def test_a_float_checkpoint_is_refused(tiny_llama) -> None:
    with pytest.raises(InputError, match="no quantized linears"):
        llmq.load_quantized(tiny_llama)


def test_bad_options(tiny_quantized) -> None:
    with pytest.raises(InputError, match="--kernels"):
        llmq.load_quantized(tiny_quantized("w4a16"), kernels="cuda")
    with pytest.raises(InputError, match="--dtype"):
        llmq.load_quantized(tiny_quantized("w4a16"), dtype="int8")
