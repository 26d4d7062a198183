"""Quantization-aware distillation: the student's decoder linears run on fake-quantized weights
(and, for W8A8 and FP8, fake-quantized inputs) with straight-through gradients, and the result
is exported by `llmq quantize`'s RTN into the compressed-tensors checkpoint whose codes
reproduce that forward exactly.

No second quantizer: the linears' arguments come from `llmq quantize`'s own plan of the student
(scheme, group size and its fallback per linear, the stored dtype the scales take), and the
forward quantizes with the same `rtn_quantize_weight`. Scales are recomputed from the weights at
every forward (min/max per group, as RTN chooses them), so the exported checkpoint's scales are
the ones the last forward used. Gradients pass the rounding unchanged (Bengio et al. 2013's
straight-through estimator): d(fake_quantize(w))/dw = 1. Activations are quantized per token
from their own absmax, as the exported checkpoint's `input_activations` (dynamic, strategy
token) say and as llmq's evaluator, vLLM and the kernels compute them; the same
straight-through gradient passes them (nothing is clipped, so there is no out-of-range input
whose gradient a clipped estimator would zero).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmq.config import QuantArgs, QuantizeOptions
from llmq.config.distill import QatScheme
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint, torch_dtype

QAT_SCHEMES = get_args(QatScheme)


@dataclass(frozen=True, slots=True)
class QatLinear:
    """How one linear runs during training: its weight arguments, the stored dtype its scales
    take, and its input activations' arguments (None: not quantized)."""

    weights: QuantArgs
    dtype: torch.dtype
    inputs: QuantArgs | None


def qat_recipe(scheme: str, group_size: int | None) -> Any:
    """The RTN recipe the export runs (and whose plan the forward follows). No clipping: the
    forward's scales come from each group's min/max, and the export must choose the same."""
    if scheme not in QAT_SCHEMES:
        raise InputError(
            f"--qat {scheme}: not a scheme quantization-aware training supports",
            hint=f"choose one of {', '.join(QAT_SCHEMES)}",
        )
    return QuantizeOptions.of(
        scheme=scheme, group_size=group_size, method="rtn", clip="none", skip_layer_check=True
    ).recipe()


def linear_args(student: Checkpoint, scheme: str, group_size: int | None) -> dict[str, QatLinear]:
    """Each quantized linear's arguments, from `llmq quantize`'s plan of the student."""
    from llmq.pipeline.plan import plan_quantization

    plan = plan_quantization(student, qat_recipe(scheme, group_size))
    return {
        linear.name: QatLinear(linear.args, torch_dtype(linear.dtype), linear.input_args)
        for layer in plan.layers
        for linear in layer
        if linear.args is not None
    }


def fake_quantized(weight: Tensor, args: QuantArgs, dtype: torch.dtype) -> Tensor:
    """The weight as the exported checkpoint will hold it (codes times scales), with the
    straight-through gradient: forward value fake_quantize(w), backward identity."""
    from llmq.quant.rtn import rtn_quantize_weight

    stored = weight.detach().to(dtype)
    restored = rtn_quantize_weight(stored.float(), args, scale_dtype=dtype).dequantize(weight.dtype)
    return weight + (restored - weight).detach()


def fake_quantized_input(x: Tensor, args: QuantArgs) -> Tensor:
    """The input as the quantized checkpoint's forward sees it (`fake_quantize`, per token),
    with the straight-through gradient."""
    from llmq.quant.primitives import fake_quantize

    with torch.no_grad():
        restored = fake_quantize(x, args)
    return x + (restored - x).detach()


def apply_qat(model: nn.Module, plan: dict[str, QatLinear]) -> int:
    """Run each planned linear of `model` on its fake-quantized weight (and input); how many.
    Parameters and their names are unchanged (resume points, DDP and the optimizer see a plain
    model)."""
    for name, linear in plan.items():
        module = model.get_submodule(name)
        module.forward = types.MethodType(_forward(linear), module)
    return len(plan)


def _forward(linear: QatLinear):
    def forward(self: nn.Linear, x: Tensor) -> Tensor:
        if linear.inputs is not None:
            x = fake_quantized_input(x, linear.inputs)
        return F.linear(x, fake_quantized(self.weight, linear.weights, linear.dtype), self.bias)

    return forward


def start_folder(staging: Path) -> Path:
    """Where `--qat-init gptq|awq` keeps the post-training solution: beside the staging folder,
    so that it is never published, and kept until the run ends (a resumed run does not redo
    it)."""
    return staging.with_name(staging.name + "-ptq-init")


def ptq_start(student: Path, folder: Path, method: str, scheme: str, group_size: int | None, progress: Any, device: str) -> None:  # fmt: skip
    """`llmq quantize --method METHOD`'s solution for the student (default calibration), once."""
    if (folder / "config.json").is_file():
        return
    recipe = QuantizeOptions.of(scheme=scheme, group_size=group_size, method=method).recipe()
    _quantize(student, folder, recipe, progress, device)


def load_start(model: nn.Module, folder: Path) -> None:
    """The student's weights set to the post-training solution's dequantized ones (with AWQ,
    the norms that took its scales too). Training then recomputes each group's scale from them
    (min/max), so step 0 is that solution's grid up to groups whose extreme took the code -8."""
    from llmq.io.checkpoint import open_checkpoint
    from llmq.runtime.load import load_dequantized

    model.load_state_dict(load_dequantized(open_checkpoint(folder)).state_dict())


def export(
    float_folder: Path, out: Path, scheme: str, group_size: int | None, progress: Any
) -> dict[str, Any]:
    """The trained student (written in float at `float_folder`) quantized by RTN into `out`."""
    return _quantize(float_folder, out, qat_recipe(scheme, group_size), progress, None).to_dict()


def _quantize(model: Path, out: Path, recipe: Any, progress: Any, device: str | None) -> Any:
    """`llmq quantize`'s job on a folder of this run's (replaced if there)."""
    from llmq.io.checkpoint import open_checkpoint
    from llmq.pipeline.job import JobRun, run_job

    ckpt = open_checkpoint(model)
    return run_job(ckpt, out, recipe, source=str(model), run=JobRun(overwrite=True, device=device), progress=progress)  # fmt: skip
