"""Parameter budgets (`--params`, `--decoder-params`): counting a config's parameters exactly,
and the MLP width that keeps a share of them; the targets a run asks for, checked."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.pruning.structured.plan import Targets, kept_sizes, pruned_config

BUDGET_CHANNELS = 64
"""`--params` and `--decoder-params` narrow the MLP to a multiple of this many channels."""


@dataclass(frozen=True, slots=True)
class ParameterCount:
    total: int  # every parameter once (a tied lm_head is the embedding)
    decoder: int  # the decoder layers' alone

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "decoder": self.decoder}


def count_parameters(config: dict[str, Any], layers: str) -> ParameterCount:
    """The parameters of the model transformers builds from `config`, exactly as it loads them
    (biases, q/k norms, a tied lm_head once), built on the meta device: nothing is allocated.
    `layers`: the decoder layers' prefix (DecoderLayout.layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**plain))
    total = decoder = 0
    for name, param in model.named_parameters():
        total += param.numel()
        decoder += param.numel() if name.startswith(f"{layers}.") else 0
    return ParameterCount(total, decoder)


def stored_parameters(ckpt: Checkpoint) -> ParameterCount:
    """Parameters as a checkpoint stores them (a tied lm_head once)."""
    layers = ckpt.layout.layers + "."
    sizes = {name: math.prod(info.shape) for name, info in ckpt.tensors.items()}
    decoder = sum(n for name, n in sizes.items() if name.startswith(layers))
    return ParameterCount(sum(sizes.values()), decoder)


def structured_targets(
    ckpt: Checkpoint,
    given: Targets,
    *,
    params: float | None = None,
    decoder_params: float | None = None,
) -> Targets:
    """The sizes a run keeps: `given`, with the MLP width of a budget (`params`: a share of all
    the parameters, `decoder_params`: of the decoder layers'); InputError, before any work, for
    targets the model cannot take or nothing to remove."""
    if params is not None and decoder_params is not None:
        raise InputError("--params and --decoder-params: give one (a share of all the parameters, or of the decoder layers')")  # fmt: skip
    targets = given
    share = params if params is not None else decoder_params
    if share is not None:
        decoder = params is None
        targets = budget_targets(ckpt.config, ckpt.layout.layers, share, decoder=decoder, given=given)  # fmt: skip
    if targets == Targets():
        raise InputError("nothing to remove", hint="give --params, --intermediate-size, --num-kv-heads, --num-heads, --hidden-size or --num-layers")  # fmt: skip
    kept_sizes(ckpt.config, targets)
    return targets


def budget_targets(
    config: dict[str, Any],
    layers: str,
    share: float,
    *,
    decoder: bool = False,
    given: Targets | None = None,
) -> Targets:
    """`--params F`: the widest MLP, a multiple of BUDGET_CHANNELS, whose model keeps at most F
    of all the source's parameters (the embedding and a tied lm_head once), so within one such
    step of F; `decoder` (`--decoder-params F`): of the decoder layers' alone. The other sizes
    are `given`'s (Minitron's guidance: width before depth, the MLP first; the hidden size, which
    narrows the embedding too, only when asked). `layers`: as in `count_parameters`."""
    option = "--decoder-params" if decoder else "--params"
    given = Targets() if given is None else given
    if not 0 < share < 1:
        raise InputError(f"{option} {share}: a share of the parameters in (0, 1)")
    if given.intermediate_size is not None:
        raise InputError(f"{option} chooses the MLP width: give it or --intermediate-size, not both")  # fmt: skip

    def counted(channels: int) -> ParameterCount:
        return count_parameters(pruned_config(config, replace(given, intermediate_size=channels)), layers)  # fmt: skip

    def part(count: ParameterCount) -> int:
        return count.decoder if decoder else count.total

    source = count_parameters(config, layers)
    whole, inter, step = part(source), config["intermediate_size"], BUDGET_CHANNELS
    of_what = f"of the {'decoder layers' if decoder else 'model'}'s {whole / 1e6:.1f}M parameters"
    widest = counted(inter)
    per_channel = part(widest) - part(counted(inter - 1)) if inter > 1 else part(widest)
    exact = inter - (part(widest) - share * whole) / per_channel  # the count is affine in the width
    if exact >= inter + step:
        raise InputError(
            f"{option} {share}: the other targets alone keep {part(widest) / whole:.1%} {of_what}",
            hint="ask for less, or keep more layers, groups or hidden channels",
        )
    channels = min(math.floor(exact / step + 1e-9) * step, inter)
    narrowest = min(step, inter)
    if channels < narrowest:
        least = counted(narrowest)
        rest = part(least) - per_channel * narrowest  # what narrowing the MLP cannot remove
        outside = 0 if decoder else least.total - least.decoder
        why = f"embeddings {outside / whole:.1%}, " if outside else ""
        raise InputError(
            f"{option} {share}: narrowing the MLP keeps at least {part(least) / whole:.1%} "
            f"{of_what} ({why}attention and norms {(rest - outside) / whole:.1%})",
            hint=f"give --hidden-size or --num-layers too: {option} sizes the MLP around them",
        )
    return replace(given, intermediate_size=channels)


def budget_reached(
    params: float | None, decoder_params: float | None, counts: dict[str, ParameterCount]
) -> dict[str, Any] | None:
    """The share asked for and the share reached (`counts`: "source" and "output"), or None
    without a budget."""
    if params is None and decoder_params is None:
        return None
    part = "total" if params is not None else "decoder"
    reached = getattr(counts["output"], part) / getattr(counts["source"], part)
    return {
        "option": "--params" if params is not None else "--decoder-params",
        "share": params if params is not None else decoder_params,
        "reached": reached,
    }
