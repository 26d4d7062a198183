"""Structured pruning (`llmq prune --structured`): remove whole MLP channels, key-value groups
(with their query heads), hidden (embedding) channels and decoder layers, the least important
first, with the same width in every layer so that the result is a plain, smaller checkpoint
every loader reads.

Importance comes from one calibration pass over the dense model (`score.score_model`): per
layer, each MLP channel's and each key-value group's L2 norm over the calibration tokens, and
the layer's Block Importance; per model, each hidden channel's L2 norm over every RMSNorm output
(llmq.pruning.importance). Each layer keeps its own most important channels and groups; the
hidden channels kept are the same everywhere (the residual stream runs through every layer);
the layers kept are those of highest Block Importance, in order.

By concern: `score` (the scoring passes, the importance file), `plan` (the sizes kept and the
units chosen), `budget` (parameter counts, `--params`), `slicing` (tensors cut to a plan),
`write` (the shards). Which module is which comes from the family layout's `StructuredRoles`.
"""

from llmq.pruning.structured.budget import (
    BUDGET_CHANNELS,
    ParameterCount,
    budget_reached,
    budget_targets,
    count_parameters,
    stored_parameters,
    structured_targets,
)
from llmq.pruning.structured.plan import (
    StructuredPlan,
    Targets,
    kept_sizes,
    plan_structured,
    pruned_config,
    structured_roles,
)
from llmq.pruning.structured.score import (
    DEPTH_METRIC_WINDOWS,
    IMPORTANCE_FORMAT,
    Importance,
    depth_by_perplexity,
    score_model,
    score_structured,
)
from llmq.pruning.structured.slicing import slice_layer, slice_outer
from llmq.pruning.structured.write import output_bytes, parameter_count, write_structured

__all__ = [
    "BUDGET_CHANNELS",
    "DEPTH_METRIC_WINDOWS",
    "IMPORTANCE_FORMAT",
    "Importance",
    "ParameterCount",
    "StructuredPlan",
    "Targets",
    "budget_reached",
    "budget_targets",
    "count_parameters",
    "depth_by_perplexity",
    "kept_sizes",
    "output_bytes",
    "parameter_count",
    "plan_structured",
    "pruned_config",
    "score_model",
    "score_structured",
    "slice_layer",
    "slice_outer",
    "stored_parameters",
    "structured_roles",
    "structured_targets",
    "write_structured",
]
