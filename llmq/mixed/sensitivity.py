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
  model's output depends on it.
- gradient: Σ_j G_j (ΔW H ΔWᵀ)_jj, the output error of each output channel j weighted by
  G_j, the mean squared gradient of the language-model loss at that output, per token (the
  Fisher in K-FAC's factored form: output gradients by input covariance, H from the same
  windows). It keeps what `output` sees of the inputs and adds what `fisher` sees of the loss,
  with per-token statistics instead of one gradient a window.
- weight: Σ ΔW², data-free.

fisher and gradient run the loss backward one decoder layer at a time (`llmq.mixed.backward`).

benchmarks/bench_mixed.py measures which of them predicts perplexity better.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from llmq.calib.collect import observed_layers
from llmq.calib.stats import ACCUM_DTYPE, CalibStats
from llmq.config import MixedConfig
from llmq.io.checkpoint import Checkpoint
from llmq.mixed.backward import backward_by_layer
from llmq.mixed.units import Candidate, Linear
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.awq import output_error

Measure = Callable[[Tensor], float]  # ΔW [out, in] -> damage


def resolved_sensitivity(ckpt: Checkpoint, sensitivity: str) -> str:
    """`auto`: gradient (the better predictor: benchmarks/RESULTS.md) for a dense model;
    output for a mixture of experts (gradient's lead is measured on dense models only)."""
    if sensitivity != "auto":
        return sensitivity
    return "output" if ckpt.layout.experts is not None else "gradient"


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
        damages = _gradient_damages if config.sensitivity == "gradient" else _fisher_damages
        return damages(ckpt, linears, candidates, windows, device, progress)
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
    progress: Progress,
) -> dict[str, list[float]]:
    """The diagonal Fisher of the loss on `input_ids` (each window's squared gradient of its
    mean loss, averaged), gathered one layer at a time, weighing each candidate's squared
    rounding error."""
    by_layer = _by_layer(ckpt, linears)
    predicted = input_ids.shape[1] - 1  # the summed loss's gradient over this: the mean's
    fisher: dict[str, Tensor] = {}
    damages: dict[str, list[float]] = {}

    def after_window(layer: nn.Module, prefix: str) -> None:
        for linear in by_layer.get(prefix, []):
            grad = _module(layer, prefix, linear).weight.grad
            _add(fisher[linear.name], (grad / predicted).square() / len(input_ids))  # type: ignore[operator]

    @contextmanager
    def watch(layer: nn.Module, prefix: str) -> Iterator[None]:
        for linear in by_layer.get(prefix, []):
            fisher[linear.name] = _zeros(_module(layer, prefix, linear), linear.rows, linear.columns)  # fmt: skip
        yield
        for linear in by_layer.get(prefix, []):
            weight, diagonal = _module(layer, prefix, linear).weight.detach(), fisher.pop(linear.name)  # fmt: skip
            damages[linear.name] = candidate_damages(
                weight, linear, candidates, lambda d, f=diagonal: float((f * d.square()).sum())
            )

    backward_by_layer(ckpt, input_ids, watch, after_window=after_window, device=device, progress=progress)  # fmt: skip
    return damages


def _gradient_damages(
    ckpt: Checkpoint,
    linears: list[Linear],
    candidates: list[Candidate],
    input_ids: Tensor,
    device: str | None,
    progress: Progress,
) -> dict[str, list[float]]:
    """Each linear's input covariance H and per-output squared loss gradients G, gathered by
    hooks while the loss goes backward one layer at a time (the loss summed over tokens, so
    each token's gradient is its own), weighing each candidate's output error channel by
    channel."""
    by_layer = _by_layer(ckpt, linears)
    tokens = input_ids.numel()
    damages: dict[str, list[float]] = {}

    @contextmanager
    def watch(layer: nn.Module, prefix: str) -> Iterator[None]:
        mine = {linear.name: (linear, _module(layer, prefix, linear)) for linear in by_layer.get(prefix, [])}  # fmt: skip
        gram = {name: _zeros(module, linear.columns, linear.columns) for name, (linear, module) in mine.items()}  # fmt: skip
        grad2 = {name: _zeros(module, linear.rows) for name, (linear, module) in mine.items()}

        def observe(name: str) -> Callable[..., None]:
            def hook(_module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).to(ACCUM_DTYPE)
                gram[name] += x.T @ x / tokens
                output.register_hook(lambda g: _add(grad2[name], g.reshape(-1, g.shape[-1]).square().sum(0) / tokens))  # fmt: skip

            return hook

        handles = [module.register_forward_hook(observe(name)) for name, (_, module) in mine.items()]  # fmt: skip
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        for name, (linear, module) in mine.items():
            h, g = gram.pop(name), grad2.pop(name)
            damages[name] = candidate_damages(
                module.weight.detach(), linear, candidates,
                lambda d, h=h, g=g: float((g[:, None] * (d @ h) * d).sum()), h.diagonal(),
            )  # fmt: skip

    backward_by_layer(ckpt, input_ids, watch, device=device, progress=progress)
    return damages


def _by_layer(ckpt: Checkpoint, linears: list[Linear]) -> dict[str, list[Linear]]:
    """The linears by their decoder layer's prefix ("model.layers.3.")."""
    prefixes = [ckpt.layout.layer_prefix(index) for index in range(ckpt.num_layers)]
    grouped: dict[str, list[Linear]] = {}
    for linear in linears:
        prefix = next(prefix for prefix in prefixes if linear.name.startswith(prefix))
        grouped.setdefault(prefix, []).append(linear)
    return grouped


def _module(layer: nn.Module, prefix: str, linear: Linear) -> nn.Module:
    return layer.get_submodule(linear.name.removeprefix(prefix))


def _zeros(module: nn.Module, *shape: int) -> Tensor:
    return torch.zeros(*shape, dtype=ACCUM_DTYPE, device=module.weight.device)


def _add(total: Tensor, value: Tensor) -> None:
    total += value.to(total)
