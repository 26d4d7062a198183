"""The zeros of a pruned student stay zero through training.

Only the weights llmq prunes are masked: the linears of the decoder layers, as the family's
layout names them (`prunable_linears`). lm_head and the embedding are never pruned, and when
tied they are one parameter whose exact zeros (a checkpoint stored in 4 bits has many) belong to
no pruning. Masks are keyed by the parameter's name in `named_parameters()`, the name the
optimizer's parameters carry, so a parameter shared by several modules has one name and one
mask.

A linear weight that is at least `MASKED_MIN_ZEROS` exact zeros was pruned (by `llmq prune` or
any other tool: the rule reads the tensors); a trained dense weight has practically none. A
student whose llmq.json records llmq's pruning keeps the zeros of every linear that has any,
however few: the first round of iterative pruning may remove less than that share. A pruned
weight's gradient is masked before each optimizer step, so AdamW's moments of it stay zero and
it never moves, and the weight is masked again after the step so that no rounding can revive
it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from llmq.distillation.sharding import local
from llmq.errors import UnsupportedModelError
from llmq.io.family import layout_for

MASKED_MIN_ZEROS = 0.10


def prunable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears llmq prunes, by the name `named_parameters()` gives their weight: a
    transformers model's decoder layers' linears, as its family's layout names them (never
    lm_head); a bare module's (no config) every linear."""
    config = getattr(model, "config", None)
    linears: list[Any]
    if config is None:
        linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    else:
        layout = layout_for(config.model_type)
        if layout.experts is not None:  # transformers holds them fused: no linears to prune
            raise UnsupportedModelError(
                "pruning a mixture of experts while distilling is not supported yet"
            )
        layers = range(config.num_hidden_layers)
        linears = [model.get_submodule(name) for i in layers for name in layout.linear_names(i)]
    names = {id(param): name for name, param in model.named_parameters()}
    return {names[id(linear.weight)]: linear for linear in linears}


def pruning_masks(model: nn.Module, *, recorded: bool = False) -> dict[str, Tensor]:
    """Parameter name -> bool mask of its non-zeros, for the decoder linears that were pruned
    (`recorded`: llmq's record says the student was pruned, so any zeros count)."""
    least = 0.0 if recorded else MASKED_MIN_ZEROS
    masks = {}
    for name, linear in prunable_linears(model).items():
        weight = linear.weight.detach()
        zeros = (weight == 0).sum().item() / weight.numel()
        if zeros > 0 and zeros >= least:
            masks[name] = weight != 0
    return masks


def mask_gradients(parameters: dict[str, nn.Parameter], masks: dict[str, Tensor]) -> None:
    """`masks` hold the rows this process has of each weight (all of them unless sharded)."""
    for name, mask in masks.items():
        grad = parameters[name].grad
        if grad is not None:
            local(grad).mul_(mask)


def mask_weights(parameters: dict[str, nn.Parameter], masks: dict[str, Tensor]) -> None:
    for name, mask in masks.items():
        local(parameters[name].data).mul_(mask)
