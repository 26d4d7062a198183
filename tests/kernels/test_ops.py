"""The kernels as torch custom ops: registered correctly (opcheck), traceable by torch.compile
through their fake implementations, Triton and reference paths agreeing, and importable
without Triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmq.kernels import ops  # noqa: F401  (registers torch.ops.llmq.*)
from llmq.pack.layout import W4A16Weight
from llmq.runtime.modules import W4A16Linear
from tests.kernels.test_w4a16 import random_weight
from tests.kernels.test_w8a8 import activations, weight_codes


def w4a16_args(triton: bool) -> tuple:
    w = random_weight(64, 128, 32, asym=True, act_order=False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).half()
    return (x, w.packed, w.scale, w.zero, w.g_idx, w.in_features, w.group_size, triton)


def w8a8_args(triton: bool) -> tuple:
    w = weight_codes(64, 128, fp8=False)
    return (activations(3, 128, torch.float16), w.codes, w.scale, None, triton)


@pytest.mark.parametrize(
    "triton", [False, pytest.param(True, marks=pytest.mark.interpreter)], ids=["torch", "triton"]
)
def test_opcheck(triton: bool) -> None:
    torch.library.opcheck(torch.ops.llmq.w4a16_linear.default, w4a16_args(triton))
    torch.library.opcheck(torch.ops.llmq.w8a8_linear.default, w8a8_args(triton))


@pytest.mark.interpreter
def test_triton_and_reference_paths_agree() -> None:
    for op, make in (
        (torch.ops.llmq.w4a16_linear, w4a16_args),
        (torch.ops.llmq.w8a8_linear, w8a8_args),
    ):
        ref = op(*make(False)).float()
        assert torch.allclose(op(*make(True)).float(), ref, rtol=2e-3, atol=2e-3)


def test_traced_by_torch_compile() -> None:
    args = w4a16_args(False)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmq.w4a16_linear(x, *args[1:]).relu()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(args[0]), f(args[0]))


def test_quantized_linears_trace_through_the_op_and_run_eager_without_it() -> None:
    """Eager calls skip the custom op's dispatch; under torch.compile the module goes through
    the op (a graph break would fail fullgraph=True)."""
    x, packed, scale, zero, g_idx, in_features, group_size, _ = w4a16_args(False)
    weight = W4A16Weight(packed, scale, zero, g_idx, in_features, group_size)
    linear = W4A16Linear(weight, triton=False)
    compiled = torch.compile(linear, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), linear(x))


@pytest.mark.process
def test_reference_path_imports_no_triton() -> None:
    code = (
        "import sys, torch, llmq.kernels.ops, llmq.runtime.load;"
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.process
def test_every_kernel_variant_compiles_for_hopper_and_ampere() -> None:
    """The interpreter forgives what compiled Triton refuses (it once hid a non-constexpr global):
    compile every variant the launchers use for sm_90 and sm_80, ahead of time, without a GPU."""
    script = Path(__file__).with_name("compile_for_gpu.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, str(script), "90", "80"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.count(": ok") >= 25
