"""Non-uniform sparsity: how much of each decoder layer to prune, for the same total.

OWL (outlier-weighed layer-wise sparsity, arXiv 2310.05175): a layer whose weights hold more
outliers (Wanda scores |W_ij|·‖x_j‖ above `OWL_THRESHOLD` times the layer's mean score, on the
dense model's activations) keeps more of them. The outlier ratios are mapped linearly onto
densities spanning 2·`OWL_SPREAD`, centred on the target density, so every layer's sparsity is
target ± OWL_SPREAD and, decoder layers being the same size, the total is the target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmq.calib.stats import CalibStats
from llmq.io.checkpoint import Checkpoint

OWL_THRESHOLD = 5.0  # the paper's M for LLaMA models
OWL_SPREAD = 0.08  # the paper's lambda


def owl_sparsities(
    ckpt: Checkpoint, stats: CalibStats, layers: Sequence[Sequence[str]], target: float
) -> tuple[list[float], list[float]]:
    """Per decoder layer, the sparsity OWL gives it and its outlier ratio. `layers`: the
    names of the linears pruned in each layer; `stats` hold their inputs' sums of squares."""
    ratios = [outlier_ratio(ckpt, stats, names) for names in layers]
    return owl_allocation(ratios, target), ratios


def outlier_ratio(
    ckpt: Checkpoint, stats: CalibStats, names: Sequence[str], threshold: float = OWL_THRESHOLD
) -> float:
    """The share of the layer's weights (its linears together) whose Wanda score exceeds
    `threshold` times the layer's mean score."""
    scores = []
    for name in names:
        squares = stats.inputs[name].sq_sum
        if squares is None:
            raise ValueError(f"{name}: statistics without sums of squares")
        weight = ckpt.read(f"{name}.weight").float()
        scores.append((weight.abs() * squares.sqrt().to(weight)).flatten())
    if not scores:
        return 0.0
    every = torch.cat(scores)
    return float((every > threshold * every.mean()).double().mean())


def owl_allocation(
    ratios: Sequence[float], target: float, spread: float = OWL_SPREAD
) -> list[float]:
    """Sparsities target ± spread, the lowest where the outlier ratio is highest (equal
    ratios: the target everywhere)."""
    d = torch.tensor(ratios, dtype=torch.float64)
    if len(d) == 0 or float(d.max() - d.min()) == 0.0:
        return [target] * len(d)
    density = (d - d.min()) / (d.max() - d.min()) * 2 * spread
    density = density - density.mean() + (1 - target)
    return (1 - density).clamp(0.0, 0.99).tolist()
