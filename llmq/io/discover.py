"""A layout for a decoder the family table does not list, found from transformers' module tree.

transformers builds the model on the meta device (no memory); one decoder layer runs there on a
meta input with hooks on every linear and norm. Linears that receive the same input tensor form
a group, in the order they run; a norm whose output is a group's input is paired with it (AWQ
and SmoothQuant fold scales there, when a probe of the norm's class shows a weight that scales
its output: x̂ · w, x̂ · w + b or x̂ · (1 + w)). Everything transformers computes outside the
layers must be what llmq's layer stream computes (embedding, rotary embedding, final norm,
head); what it cannot see, it refuses in one line naming what is missing.

A discovered layout quantizes in one observed pass per layer (no group-by-group staging: its
blocks' outputs are not known to be their last linear's), and the report prints it.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from llmq.errors import UnsupportedModelError
from llmq.io.layout import DecoderLayout

# Config keys of scales that transformers applies outside the decoder layers (Granite's,
# MiniCPM's): llmq's stream would not apply them, so such models are refused.
MODEL_LEVEL_SCALES = (
    "embedding_multiplier", "logits_scaling", "logit_scale", "scale_emb", "dim_model_base",
)  # fmt: skip


def discover_layout(config: dict[str, Any], supported: list[str]) -> DecoderLayout:
    """The layout of `config`'s model found from its module tree; UnsupportedModelError naming
    what is missing otherwise (`supported`: the table's families, for the hint)."""
    model_type = config.get("model_type")

    def refuse(what: str) -> NoReturn:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not in llmq's family table, and {what}",
            hint=f"families llmq knows by name: {', '.join(supported)}",
        )

    scales = [key for key in MODEL_LEVEL_SCALES if config.get(key) not in (None, 1, 1.0)]
    if scales:
        refuse(f"it scales outside its layers ({', '.join(scales)}), which llmq does not apply")
    model = _meta_model(config, refuse)
    names = {id(module): name for name, module in model.named_modules()}
    count = getattr(model.config, "num_hidden_layers", None)  # n_layer and the like mapped
    layers = [
        module for module in model.modules()
        if isinstance(module, nn.ModuleList) and len(module) == count
    ]  # fmt: skip
    if len(layers) != 1:
        refuse("its module tree has no single list of num_hidden_layers decoder layers")
    layer = layers[0][0]
    if any(parameter.ndim > 2 for parameter in layer.parameters()):
        refuse("its layers hold 3-D weights (fused experts llmq does not know)")
    if "position_embeddings" not in inspect.signature(layer.forward).parameters:
        refuse("its layers take no rotary position embeddings (learned or ALiBi positions)")
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(rotary) != 1:
        refuse("it has no single model-level rotary embedding")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear):
        refuse("its embedding or output head is not a plain embedding and linear")
    layers_name = names[id(layers[0])]
    final_norm = _final_norm(model, layers_name, names, refuse)
    groups, producers = _trace(layer, rotary[0], model.config, refuse)
    blocks = list(dict.fromkeys(group[0].split(".")[0] for group in groups))
    if len(blocks) < 2:
        refuse("its layers have no separate attention and MLP modules")
    offset, foldable = _foldable_norms(layer, set(producers.values()))
    smooth = tuple(
        (producers[index], group)
        for index, group in enumerate(groups)
        if producers.get(index) in foldable
    )
    return DecoderLayout(
        embed=names[id(embed)], layers=layers_name, final_norm=final_norm,
        lm_head=names[id(head)], rotary=names[id(rotary[0])], attention=blocks[0],
        mlp=blocks[-1], sequential=tuple(groups), smooth=smooth,
        fixed_alpha_producers=tuple(dict.fromkeys(pair[0] for pair in smooth)),
        norm_weight_offset=offset, discovered=True,
    )  # fmt: skip


def describe_layout(layout: DecoderLayout) -> list[str]:
    """What a discovered layout found, for the report: its groups and norm pairings."""
    groups = "; ".join(", ".join(group) for group in layout.sequential)
    pairs = "; ".join(f"{norm} -> {', '.join(group)}" for norm, group in layout.smooth)
    return [
        f"layers {layout.layers}.N, linears by shared input: {groups}",
        f"norm pairings (AWQ, SmoothQuant): {pairs or 'none'}",
    ]


def _meta_model(config: dict[str, Any], refuse: Any) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {key: value for key, value in config.items() if key != "quantization_config"}
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(**plain))
    except Exception as exc:  # transformers raises anything (even AssertionError) on a config
        refuse(f"transformers builds no causal language model from its config ({exc})")


def _final_norm(model: nn.Module, layers: str, names: dict[int, str], refuse: Any) -> str:
    """The norm beside the layers (under the same parent) that the head reads."""
    parent = layers.rpartition(".")[0]
    norms = [
        names[id(module)] for module in (model.get_submodule(parent) if parent else model).children()
        if "norm" in type(module).__name__.lower()
    ]  # fmt: skip
    if len(norms) != 1:
        refuse("it has no single final norm beside its layers")
    return norms[0]


def _trace(
    layer: nn.Module, rotary: nn.Module, config: Any, refuse: Any
) -> tuple[list[tuple[str, ...]], dict[int, str]]:
    """Run `layer` on the meta device: its linears grouped by the input tensor they receive,
    in the order they run, and the norm producing each group's input (by group index)."""
    inputs: list[tuple[str, Tensor]] = []  # the tensors are kept: their ids stay unique
    outputs: list[tuple[str, Tensor]] = []
    hooks = []
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, name=name: inputs.append((name, args[0]))))  # fmt: skip
        elif "norm" in type(module).__name__.lower():
            hooks.append(module.register_forward_hook(
                lambda _m, _a, out, name=name: outputs.append((name, out))))  # fmt: skip
    hidden = torch.zeros(1, 8, int(config.hidden_size), device="meta")
    by_type = {}  # one rotary table per attention type (as LayerStream calls it)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        by_type["layer_type"] = config.layer_types[0]
    try:
        positions = torch.arange(8, device="meta").unsqueeze(0)
        cos_sin = rotary(hidden, positions, **by_type)
        layer(hidden, attention_mask=None, position_embeddings=cos_sin)
    except Exception as exc:  # any failure means the layer cannot run as llmq calls it
        refuse(f"its layer does not run as llmq runs layers ({type(exc).__name__}: {exc})")
    finally:
        for hook in hooks:
            hook.remove()
    linears = {name for name, module in layer.named_modules() if isinstance(module, nn.Linear)}
    if not linears or {name for name, _ in inputs} != linears:
        refuse("its layers have linears that do not run on the layer's input (or none)")
    groups: dict[int, list[str]] = {}
    for name, tensor in inputs:
        groups.setdefault(id(tensor), []).append(name)
    produced = {id(tensor): name for name, tensor in outputs}
    ordered = list(groups.items())
    producers = {i: produced[key] for i, (key, _) in enumerate(ordered) if key in produced}
    return [tuple(names) for _, names in ordered], producers


def _foldable_norms(layer: nn.Module, norms: set[str]) -> tuple[float, set[str]]:
    """The norms whose weight scales their output (so a scale folds into it), and their offset
    (0: x̂ · w, 1: x̂ · (1 + w)); norms of another form, or of the minority offset, are left out."""
    offsets: dict[str, float] = {}
    for name in norms:
        offset = _weight_offset(layer.get_submodule(name))
        if offset is not None:
            offsets[name] = offset
    if not offsets:
        return 0.0, set()
    common = max(set(offsets.values()), key=list(offsets.values()).count)
    return common, {name for name, offset in offsets.items() if offset == common}


def _weight_offset(norm: nn.Module) -> float | None:
    """0 or 1 when `norm` computes x̂ · (offset + w) (+ b), x̂ being x normalized as RMSNorm or
    LayerNorm does, on a probe of its class with random weights; None for anything else."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or weight.ndim != 1:
        return None
    probe = copy.deepcopy(norm).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    width = weight.shape[0]
    with torch.no_grad():
        for parameter in probe.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        x = torch.randn(3, width, generator=generator)
        try:
            got = probe(x)
        except Exception:  # a norm that cannot run alone: not foldable
            return None
        bias = getattr(probe, "bias", None)
        shift = bias if isinstance(bias, Tensor) else 0.0
        centered = x - x.mean(-1, keepdim=True)
        for normalized in (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(),
                           centered / centered.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()):  # fmt: skip
            for offset in (0.0, 1.0):
                expected = normalized * (offset + probe.weight) + shift
                if torch.allclose(got, expected, rtol=1e-3, atol=1e-3):
                    return offset
    return None
