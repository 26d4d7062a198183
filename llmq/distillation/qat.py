"""Quantization-aware distillation: the student's decoder linears run on fake-quantized weights
with straight-through gradients, and the result is exported by `llmq quantize`'s RTN into the
compressed-tensors checkpoint whose integer codes reproduce that forward exactly.

No second quantizer: the linears' arguments come from `llmq quantize`'s own plan of the student
(scheme, group size and its fallback per linear, the stored dtype the scales take), and the
forward quantizes with the same `rtn_quantize_weight`. Scales are recomputed from the weights at
every forward (min/max per group, as RTN chooses them), so the exported checkpoint's scales are
the ones the last forward used. Gradients pass the rounding unchanged (Bengio et al. 2013's
straight-through estimator): d(fake_quantize(w))/dw = 1.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmq.config import QuantArgs
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint, torch_dtype

WEIGHT_ONLY = ("w4a16", "w4a16-asym", "w8a16")


def qat_recipe(scheme: str, group_size: int | None) -> Any:
    """The RTN recipe the export runs (and whose plan the forward follows)."""
    from llmq.api.quantize import make_recipe

    if scheme not in WEIGHT_ONLY:
        raise InputError(
            f"--qat {scheme}: not a weight-only integer scheme",
            hint=f"choose one of {', '.join(WEIGHT_ONLY)}",
        )
    return make_recipe(scheme=scheme, group_size=group_size, method="rtn", skip_layer_check=True)


def linear_args(student: Checkpoint, scheme: str, group_size: int | None) -> dict[str, tuple[QuantArgs, torch.dtype]]:  # fmt: skip
    """Each quantized linear's arguments and stored dtype, from `llmq quantize`'s plan."""
    from llmq.pipeline.plan import plan_quantization

    plan = plan_quantization(student, qat_recipe(scheme, group_size))
    return {
        linear.name: (linear.args, torch_dtype(linear.dtype))
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


def apply_qat(model: nn.Module, plan: dict[str, tuple[QuantArgs, torch.dtype]]) -> int:
    """Run each planned linear of `model` on its fake-quantized weight; how many. Parameters and
    their names are unchanged (resume points, DDP and the optimizer see a plain model)."""
    for name, (args, dtype) in plan.items():
        linear = model.get_submodule(name)
        linear.forward = types.MethodType(_forward(args, dtype), linear)
    return len(plan)


def _forward(args: QuantArgs, dtype: torch.dtype):
    def forward(self: nn.Linear, x: Tensor) -> Tensor:
        return F.linear(x, fake_quantized(self.weight, args, dtype), self.bias)

    return forward


def start_folder(staging: Path) -> Path:
    """Where `--qat-init gptq|awq` keeps the post-training solution: beside the staging folder,
    so that it is never published, and kept until the run ends (a resumed run does not redo
    it)."""
    return staging.with_name(staging.name + "-ptq-init")


def ptq_start(student: Path, folder: Path, method: str, scheme: str, group_size: int | None, progress: Any, device: str) -> None:  # fmt: skip
    """`llmq quantize --method METHOD`'s solution for the student (default calibration), once."""
    from llmq.api.quantize import make_recipe, quantize

    if (folder / "config.json").is_file():
        return
    recipe = make_recipe(scheme=scheme, group_size=group_size, method=method)
    quantize(student, folder, recipe=recipe, overwrite=True, progress=progress, device=device)


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
    from llmq.api.quantize import quantize

    return quantize(
        float_folder, out, recipe=qat_recipe(scheme, group_size), overwrite=True,
        progress=progress,
    ).to_dict()  # fmt: skip
