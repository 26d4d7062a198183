"""A mixture of experts as plain linears, named as the checkpoint names them.

transformers 5 holds a layer's experts fused in 3-D parameters (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I]); checkpoints and vLLM name every expert's linears (`experts.3.gate_proj`).
llmq swaps the fused module for `UnfusedExperts` before loading a layer, so the checkpoint's
tensors load under their own names, every method (input hooks, GPTQ, AWQ, RTN) sees ordinary
`nn.Linear`s, and what is written goes back under the names it came from.

By default every token runs through every expert (`--moe-calibration all`): each expert's
statistics see the whole calibration text, so an expert the router rarely picks is calibrated
like the others, while the layer's output stays the model's own, each token's output the
routing-weighted sum of its chosen experts only. `routed` runs each expert on the tokens the
router sends it, as the model does. Either way the module counts the tokens routed to each
expert: the coverage report (`take_routed_tokens`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from llmq.io.layout import DecoderLayout, Experts


class _Gated(nn.Module):
    """act(gate) · up: the gated MLP of most families."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act(gate) * up


class _ClampedGated(nn.Module):
    """GPT-OSS's gating (transformers' GptOssExperts._apply_gate): gate clamped from above and
    up on both sides at `limit`, then (up + 1) · gate · sigmoid(alpha · gate)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class _Expert(nn.Module):
    """One gated expert: down(gated(gate(x), up(x))), its linears under the checkpoint's names."""

    def __init__(
        self, names: Experts, hidden: int, intermediate: int, gated: nn.Module, bias: bool
    ) -> None:
        super().__init__()
        self._names = names
        for role, shape in (("gate", (hidden, intermediate)), ("up", (hidden, intermediate)),
                            ("down", (intermediate, hidden))):  # fmt: skip
            self.add_module(getattr(names, role), nn.Linear(*shape, bias=bias))
        self.gated = gated

    def forward(self, x: Tensor) -> Tensor:
        names = self._names
        gate, up, down = (self.get_submodule(getattr(names, r)) for r in ("gate", "up", "down"))
        return down(self.gated(gate(x), up(x)))


class UnfusedExperts(nn.Module):
    """Drop-in for transformers' fused experts module: the same call (tokens [T, H], each
    token's chosen experts [T, k] and their weights [T, k]) and the same output [T, H]."""

    def __init__(self, names: Experts, fused: nn.Module) -> None:
        super().__init__()
        if names.stored_fused:  # GPT-OSS: [E, hidden, 2 x intermediate], biased
            count, hidden, double_intermediate = fused.gate_up_proj.shape
            gated: nn.Module = _ClampedGated(fused.alpha, fused.limit)
        else:  # [E, 2 x intermediate, hidden]
            count, double_intermediate, hidden = fused.gate_up_proj.shape
            gated = _Gated(fused.act_fn)
        self.count = count
        self.every_token = True
        self.routed_tokens: Tensor | None = None  # per expert, since the last take_routed_tokens
        for e in range(count):  # children "0", "1", ...: `experts.3.gate_proj`, as on disk
            expert = _Expert(names, hidden, double_intermediate // 2, gated, names.stored_fused)
            self.add_module(str(e), expert)

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        # counted where the tokens are: a copy to the CPU per batch would wait for the GPU
        counts = torch.bincount(top_k_index.flatten(), minlength=self.count)
        self.routed_tokens = counts if self.routed_tokens is None else self.routed_tokens + counts
        output = torch.zeros_like(hidden)
        for e in range(self.count):
            expert = self.get_submodule(str(e))
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True).to(hidden.dtype)
            if self.every_token:
                output += expert(hidden) * weight
                continue
            rows = (top_k_index == e).any(dim=-1).nonzero().squeeze(-1)
            if len(rows):
                output.index_add_(0, rows, expert(hidden[rows]) * weight[rows])
        return output


ExpertTokens = Literal["all", "routed"]  # --moe-calibration


def unfuse_experts(model: nn.Module, layout: DecoderLayout, tokens: ExpertTokens = "all") -> None:
    """Swap the fused experts module of each of `model`'s decoder layers for `UnfusedExperts`
    (running `tokens` through each expert), on the same device (meta in a skeleton, whose
    weights are loaded afterwards)."""
    names = layout.experts
    if names is None:
        return
    for index, layer in enumerate(model.get_submodule(layout.layers)):
        if layout.at(index).experts is None:  # a dense layer of the mixture (DeepSeek's first)
            continue
        if names.loaded_as is not None:
            _register_under_checkpoint_name(layer, names.loaded_as, layout.mlp)
        fused = layer.get_submodule(names.module)
        with torch.device(fused.gate_up_proj.device):
            unfused = UnfusedExperts(names, fused)
        unfused.every_token = tokens == "all"
        layer.set_submodule(names.module, unfused)


def _register_under_checkpoint_name(layer: nn.Module, attribute: str, name: str) -> None:
    """Make the block transformers keeps as `layer.<attribute>` a child named `name`, as the
    checkpoint names it: the layer's forward still finds `self.<attribute>` (a plain attribute
    now), while state dicts, hooks and written tensors use the checkpoint's names."""
    block = layer.get_submodule(attribute)
    delattr(layer, attribute)
    layer.add_module(name, block)
    object.__setattr__(layer, attribute, block)


def take_routed_tokens(layer: nn.Module) -> list[int] | None:
    """The tokens the router sent to each expert of `layer` since the last call (a token
    counts once for each of its top-k experts); None for a layer without experts."""
    for module in layer.modules():
        if isinstance(module, UnfusedExperts):
            counts, module.routed_tokens = module.routed_tokens, None
            return [0] * module.count if counts is None else counts.tolist()
    return None
