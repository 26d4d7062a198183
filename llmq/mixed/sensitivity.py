"""Each linear's damage under each candidate, measured before anything is quantized: the weight
rounded to nearest under the candidate (GGUF's types: on the grid their scale search picks with
the inputs' mean squares), ΔW = Q(W) - W, scored these ways.

- output: Σ_rows ΔW H ΔWᵀ, the squared error of the linear's output on the calibration inputs
  (H = 2 XᵀX / n, GPTQ's Hessian), gathered on the float model one layer at a time.
- residual: the same, over the mean square of the residual stream entering the layer. A layer's
  error is added to that stream, which every later layer reads through a norm: what it changes
  is its size relative to the stream's, and the stream grows along the depth (raw output errors
  rank the last layers' linears first for that alone).
- fisher: Σ F ⊙ ΔW², F the diagonal (empirical) Fisher of the language-model loss on a few
  calibration windows: the loss's second-order change, which weighs each linear by how much the
  model's output depends on it. Needs the whole model and its gradients in memory.
- gradient: Σ_j G_j (ΔW H ΔWᵀ)_jj, the output error of each output channel j weighted by
  G_j, the mean squared gradient of the language-model loss at that output, per token (the
  Fisher in K-FAC's factored form: output gradients by input covariance, H from the same
  windows). It keeps what `output` sees of the inputs and adds what `fisher` sees of the loss,
  with per-token statistics instead of one gradient a window. Whole model in memory.
- weight: Σ ΔW², data-free.

benchmarks/bench_mixed.py measures which of them predicts perplexity better.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
from torch import Tensor, nn

from llmq.calib.collect import observed_layers
from llmq.calib.stats import ACCUM_DTYPE, CalibStats
from llmq.config import MixedConfig
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.mixed.units import Candidate, Linear
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.awq import output_error

Measure = Callable[[Tensor], float]  # ΔW [out, in] -> damage
# `gradient` and `fisher` hold the float32 model, its gradients and one window's activations:
# about this many times the float32 weights
WHOLE_MODEL_FACTOR = 4


def resolved_sensitivity(ckpt: Checkpoint, sensitivity: str, device: str | None) -> str:
    """`auto`: gradient (the better predictor: benchmarks/RESULTS.md) where the whole model fits
    in half the free memory of the device, is dense and is stored as transformers reads it (not
    an FP8 release read as bfloat16); output (one layer at a time) elsewhere."""
    if sensitivity != "auto":
        return sensitivity
    if ckpt.layout.experts is not None or ckpt.views:
        return "output"
    weights = sum(math.prod(info.shape) for info in ckpt.tensors.values())
    return "gradient" if WHOLE_MODEL_FACTOR * 4 * weights <= _free_memory(device) / 2 else "output"


def _free_memory(device: str | None) -> int:
    from llmq.calib.stream import resolve_device

    where = resolve_device(device)
    if where.type == "cuda":
        return int(torch.cuda.mem_get_info(where)[0])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def candidate_damages(
    weight: Tensor,
    linear: Linear,
    candidates: list[Candidate],
    measure: Measure,
    importance: Tensor | None = None,
) -> list[float]:
    """`measure` of the rounding error under each candidate (0 where stored exactly).
    `importance`: each input's weight in the candidates' own scale searches (GGUF's)."""
    exact = weight.to(ACCUM_DTYPE)
    damages = []
    for candidate in candidates:
        rounded = candidate.rounded(weight, linear, importance)
        damages.append(0.0 if rounded is None else measure(rounded - exact))
    return damages


def measure_damages(
    ckpt: Checkpoint,
    linears: list[Linear],
    candidates: list[Candidate],
    config: MixedConfig,
    input_ids: Tensor | None,
    stats: CalibStats | None = None,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> dict[str, list[float]]:
    """Each linear's damage under each candidate, as `config.sensitivity` says. `input_ids`:
    the calibration windows (None for `weight`); `stats`: a statistics file's Hessians, read
    instead of a pass over the data when they cover every linear."""
    if config.sensitivity in ("fisher", "gradient"):
        assert input_ids is not None
        windows = input_ids[: config.fisher_windows]
        if config.sensitivity == "gradient":
            return _gradient_damages(ckpt, linears, candidates, windows, device)
        return _fisher_damages(ckpt, linears, candidates, windows, device)
    hessians = stats is not None and all(
        name in stats.inputs and stats.inputs[name].hessian is not None
        for name in (linear.name for linear in linears)
    )
    measured_on_data = config.sensitivity in ("output", "residual")
    observe = measured_on_data and (not hessians or config.sensitivity == "residual")
    wanted = {linear.name: linear for linear in linears}
    damages: dict[str, list[float]] = {}
    for layer in observed_layers(
        ckpt, input_ids if observe else None, hessian=True, progress=progress, device=device,
        label="measuring sensitivity",
    ):  # fmt: skip
        for name, module in layer.module.named_modules():
            linear = wanted.get(layer.prefix + name)
            if linear is None:
                continue
            measure, importance = _squared, None
            if measured_on_data:
                source = stats.inputs[linear.name] if hessians else layer.stats[name]  # type: ignore[union-attr]
                scale = layer.input_energy if config.sensitivity == "residual" else 1.0
                measure = _output_measure(source.hessian, scale)
                importance = source.hessian.diagonal()
            damages[linear.name] = candidate_damages(module.weight.data, linear, candidates, measure, importance)  # fmt: skip
    return damages


def _squared(delta: Tensor) -> float:
    return float(delta.square().sum())


def _output_measure(hessian: Tensor | None, scale: float | None = 1.0) -> Measure:
    """The output error on the inputs of `hessian`, over `scale`."""
    assert hessian is not None and scale is not None
    return lambda delta: float(output_error(delta, hessian.to(delta.device))) / scale


def _fisher_damages(
    ckpt: Checkpoint,
    linears: list[Linear],
    candidates: list[Candidate],
    input_ids: Tensor,
    device: str | None,
) -> dict[str, list[float]]:
    """The diagonal Fisher of the whole model's loss on `input_ids`, one window at a time (each
    window's squared gradient, averaged), weighing each candidate's squared rounding error."""
    model = _whole_model(ckpt, device)
    weights = {linear.name: model.get_submodule(linear.name).weight for linear in linears}
    fisher = {name: torch.zeros_like(weight) for name, weight in weights.items()}

    def accumulate() -> None:
        for name, weight in weights.items():
            fisher[name] += weight.grad.square() / len(input_ids)  # type: ignore[union-attr]

    _backward_each_window(model, input_ids, accumulate, summed=False)
    damages = {}
    for linear in linears:
        weight, diagonal = weights[linear.name].detach(), fisher.pop(linear.name)
        damages[linear.name] = candidate_damages(
            weight, linear, candidates, lambda delta, f=diagonal: float((f * delta.square()).sum())
        )
    return damages


def _gradient_damages(
    ckpt: Checkpoint,
    linears: list[Linear],
    candidates: list[Candidate],
    input_ids: Tensor,
    device: str | None,
) -> dict[str, list[float]]:
    """Each linear's input covariance H and per-output squared loss gradients G, gathered by
    hooks over `input_ids` (the loss summed over tokens, so each token's gradient is its own),
    weighing each candidate's output error channel by channel."""
    model = _whole_model(ckpt, device)
    gram = {linear.name: torch.zeros(linear.columns, linear.columns) for linear in linears}
    grad2 = {linear.name: torch.zeros(linear.rows) for linear in linears}
    tokens = input_ids.numel()

    def observe(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(ACCUM_DTYPE)
            gram[name] += (x.T @ x).cpu() / tokens
            output.register_hook(lambda g: _add(grad2[name], g.reshape(-1, g.shape[-1]).square().sum(0) / tokens))  # fmt: skip

        return hook

    handles = [model.get_submodule(one.name).register_forward_hook(observe(one.name)) for one in linears]  # fmt: skip
    try:
        _backward_each_window(model, input_ids, lambda: None, summed=True)
    finally:
        for handle in handles:
            handle.remove()
    damages = {}
    for linear in linears:
        weight = model.get_submodule(linear.name).weight.detach()
        h, g = gram.pop(linear.name).to(weight.device), grad2.pop(linear.name).to(weight.device)
        damages[linear.name] = candidate_damages(
            weight, linear, candidates, lambda d, h=h, g=g: float((g[:, None] * (d @ h) * d).sum()),
            h.diagonal(),
        )  # fmt: skip
    return damages


def _backward_each_window(
    model: nn.Module, input_ids: Tensor, after: Callable[[], None], *, summed: bool
) -> None:
    """The loss of each window backward in turn, `after` reading the gradients before they are
    cleared. `summed`: the loss summed over the predicted tokens (each token's gradient its
    own), else their mean (the window's gradient)."""
    for window in input_ids.to(next(model.parameters()).device):
        loss = model(input_ids=window[None], labels=window[None]).loss
        (loss * (len(window) - 1) if summed else loss).backward()
        after()
        model.zero_grad(set_to_none=True)


def _add(total: Tensor, value: Tensor) -> None:
    total += value.to(total)


def _whole_model(ckpt: Checkpoint, device: str | None) -> nn.Module:
    """The float32 model with gradients for its weights (the calibration pass's device); a
    mixture of experts is refused: transformers holds its experts fused, not as the checkpoint's
    linears."""
    from transformers import AutoModelForCausalLM

    from llmq.calib.stream import resolve_device

    hint = "use --sensitivity output (measured one layer at a time)"
    if ckpt.layout.experts is not None:
        raise InputError(
            "--sensitivity fisher and gradient: transformers holds a mixture's experts fused, "
            "not as the checkpoint's linears",
            hint=hint,
        )
    if ckpt.views:
        raise InputError("--sensitivity fisher and gradient: transformers would load this FP8 release's codes, not the bfloat16 weights llmq reads", hint=hint)  # fmt: skip

    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    model.to(resolve_device(device)).eval()
    return model
