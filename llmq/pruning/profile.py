"""Non-uniform sparsity: how much of each decoder layer to prune, for the same total.

Two profiles, both measured on the dense model's activations (sums of squares of each linear's
inputs, one calibration pass), both mapping a per-layer measure linearly onto densities spanning
2·`PROFILE_SPREAD`, centred on the target density, so every layer's sparsity is target ±
PROFILE_SPREAD and, decoder layers being the same size, the total is the target:

- OWL (outlier-weighed layer-wise sparsity, arXiv 2310.05175): a layer whose weights hold more
  outliers (Wanda scores |W_ij|·‖x_j‖ above `OWL_THRESHOLD` times the layer's mean score) keeps
  more of them.
- scan: a layer whose pruning costs more keeps more. The cost is `llmq fallback-scan`'s output
  error estimate Σ_j ‖ΔW_:j‖² E[x_j²] (the diagonal approximation of E‖ΔW x‖²), with ΔW the
  weights the method's own score drops at the target sparsity, relative to the layer's output
  Σ_j ‖W_:j‖² E[x_j²] (the scan's activation-weighted NRMSE, squared). Relative, because the
  residual stream grows with depth: the absolute errors (also recorded, as shares of the total)
  rank the last layers costliest, and sparing them measured far worse than uniform
  (benchmarks/RESULTS.md). OWL counts outliers; this weighs what pruning actually removes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmq.calib.stats import CalibStats
from llmq.io.checkpoint import Checkpoint
from llmq.quant.masks import Sparsity, magnitude_scores, pruned_mask, wanda_scores

OWL_THRESHOLD = 5.0  # the paper's M for LLaMA models
PROFILE_SPREAD = 0.08  # OWL's lambda


def owl_sparsities(
    ckpt: Checkpoint, stats: CalibStats, layers: Sequence[Sequence[str]], target: float
) -> tuple[list[float], list[float]]:
    """Per decoder layer, the sparsity OWL gives it and its outlier ratio. `layers`: the
    names of the linears pruned in each layer; `stats` hold their inputs' sums of squares."""
    ratios = [outlier_ratio(ckpt, stats, names) for names in layers]
    return spread_allocation(ratios, target), ratios


def scan_sparsities(
    ckpt: Checkpoint,
    stats: CalibStats,
    layers: Sequence[Sequence[str]],
    target: float,
    method: str,
) -> tuple[list[float], list[float], list[float]]:
    """Per decoder layer: the sparsity the scan profile gives it, the relative output error of
    pruning it to `target` with `method`'s score, and its share of the model's absolute error."""
    errors, outputs = [], []
    for names in layers:
        pairs = [pruning_error(ckpt, stats, name, target, method) for name in names]
        errors.append(sum(error for error, _ in pairs))
        outputs.append(sum(output for _, output in pairs))
    relative = [error / output if output else 0.0 for error, output in zip(errors, outputs, strict=True)]  # fmt: skip
    total = sum(errors)
    shares = [error / total if total else 0.0 for error in errors]
    return spread_allocation(relative, target), relative, shares


def pruning_error(
    ckpt: Checkpoint, stats: CalibStats, name: str, target: float, method: str
) -> tuple[float, float]:
    """Σ_j ‖ΔW_:j‖² Σ_tokens x_j² for ΔW the weights of linear `name` that `method`'s score
    (magnitude, or Wanda's for wanda and sparsegpt, whose mask Wanda's approximates) drops at
    `target`, and the same sum over all of W: the squared output error and the squared output
    per calibration pass, up to one constant."""
    squares = _input_squares(stats, name)
    weight = ckpt.read(f"{name}.weight").float()
    norms = squares.sqrt().to(weight)
    scores = magnitude_scores(weight) if method == "magnitude" else wanda_scores(weight, norms)
    dropped = pruned_mask(scores, Sparsity(fraction=target))
    energy = (weight.square() * squares.to(weight)).double()
    return float(energy[dropped].sum()), float(energy.sum())


def outlier_ratio(
    ckpt: Checkpoint, stats: CalibStats, names: Sequence[str], threshold: float = OWL_THRESHOLD
) -> float:
    """The share of the layer's weights (its linears together) whose Wanda score exceeds
    `threshold` times the layer's mean score."""
    scores = []
    for name in names:
        norms = _input_squares(stats, name).sqrt()
        weight = ckpt.read(f"{name}.weight").float()
        scores.append(wanda_scores(weight, norms).flatten())
    if not scores:
        return 0.0
    every = torch.cat(scores)
    return float((every > threshold * every.mean()).double().mean())


def _input_squares(stats: CalibStats, name: str) -> torch.Tensor:
    squares = stats.inputs[name].sq_sum
    if squares is None:
        raise ValueError(f"{name}: statistics without sums of squares")
    return squares


def spread_allocation(
    measures: Sequence[float], target: float, spread: float = PROFILE_SPREAD
) -> list[float]:
    """Sparsities target ± spread, the lowest where the measure is highest (equal measures:
    the target everywhere)."""
    d = torch.tensor(measures, dtype=torch.float64)
    if len(d) == 0 or float(d.max() - d.min()) == 0.0:
        return [target] * len(d)
    density = (d - d.min()) / (d.max() - d.min()) * 2 * spread
    density = density - density.mean() + (1 - target)
    return (1 - density).clamp(0.0, 0.99).tolist()
