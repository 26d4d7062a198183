"""The zeros of a pruned student stay zero through training.

A linear weight that is at least `MASKED_MIN_ZEROS` exact zeros was pruned (by `llmq prune` or
any other tool: the rule reads the tensors); a trained dense weight has practically none. A
student whose llmq.json records llmq's pruning keeps the zeros of every linear that has any,
however few: the first round of iterative pruning may remove less than that share. A pruned
weight's gradient is masked before each optimizer step, so AdamW's moments of it stay zero and
it never moves, and the weight is masked again after the step so that no rounding can revive
it.
"""

from __future__ import annotations

from torch import Tensor, nn

from llmq.distillation.sharding import local

MASKED_MIN_ZEROS = 0.10


def pruning_masks(model: nn.Module, *, recorded: bool = False) -> dict[str, Tensor]:
    """name of a linear weight -> bool mask of its non-zeros, for the weights that were pruned
    (`recorded`: llmq's record says the student was pruned, so any zeros count)."""
    least = 0.0 if recorded else MASKED_MIN_ZEROS
    masks = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight.detach()
        zeros = (weight == 0).sum().item() / weight.numel()
        if zeros > 0 and zeros >= least:
            masks[f"{name}.weight"] = weight != 0
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
