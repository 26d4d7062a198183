"""Read a compressed-tensors checkpoint back: which linears are quantized, how, and their
dequantized weights. Works on llmq's output and on other tools' (targets by name, `re:` regex
or class name `Linear`, as compressed-tensors matches them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from torch import Tensor

from llmq.config import QuantArgs, get_scheme
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.io.fused_experts import ROLES
from llmq.io.layout import DecoderLayout
from llmq.pack.format import (
    PackFormat,
    config_target,
    decompress,
    input_scale_name,
    quantization_config,
)
from llmq.quant.kvcache import KV_SCALE_NAMES, KVQuantizer

_ARG_FIELDS = (
    "num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic",
    "scale_dtype",
)  # fmt: skip
# read where they are used
_SCALE_LEAVES = ("input_scale", "input_global_scale", "input_zero_point", *KV_SCALE_NAMES)
_COMPRESSED_SUFFIXES = (
    "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
    "weight_global_scale",
)  # fmt: skip
_STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group")


@dataclass(frozen=True, slots=True)
class LinearScheme:
    weights: QuantArgs
    input_activations: QuantArgs | None


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (name, "Linear")


def _quant_args(raw: dict[str, Any] | None, where: str) -> QuantArgs | None:
    if raw is None:
        return None
    if raw.get("strategy") not in _STRATEGIES:
        raise InputError(f"{where}: strategy {raw.get('strategy')!r} is not supported by llmq")
    if raw.get("actorder") not in (None, "static", False):
        raise InputError(f"{where}: actorder {raw.get('actorder')!r} is not supported by llmq yet")
    try:
        return QuantArgs(**{k: raw[k] for k in _ARG_FIELDS if k in raw})
    except ValidationError as exc:
        raise InputError(
            f"{where}: unsupported quantization args ({exc.errors()[0]['msg']})"
        ) from None


class QuantizedView:
    """The quantization_config of a checkpoint, resolved per linear module name."""

    def __init__(self, ckpt: Checkpoint) -> None:
        config = ckpt.quantization_config or {}
        if ckpt.views and config.get("quant_method") == "mxfp4":
            config = _mxfp4_release_view(ckpt.layout)
        if config and config.get("quant_method") != "compressed-tensors":
            raise InputError(
                f"{ckpt.path}: quant_method {config.get('quant_method')!r} is not supported",
                hint="llmq reads compressed-tensors checkpoints",
            )
        self.ignore: list[str] = list(config.get("ignore") or [])
        self.groups: list[tuple[list[str], LinearScheme]] = []
        for group_name, group in (config.get("config_groups") or {}).items():
            where = f"{ckpt.path}: quantization_config.config_groups.{group_name}"
            weights = _quant_args(group.get("weights"), where)
            if weights is None:
                continue
            activations = _quant_args(group.get("input_activations"), where)
            if activations is not None and not (activations.dynamic or activations.symmetric):
                raise InputError(f"{where}: asymmetric static input scales are not supported")
            scheme = LinearScheme(weights, activations)
            self.groups.append((list(group.get("targets") or []), scheme))
        where = f"{ckpt.path}: quantization_config.kv_cache_scheme"
        self.kv_cache = _quant_args(config.get("kv_cache_scheme"), where)
        if self.kv_cache is not None and self.kv_cache.strategy != "tensor":
            raise InputError(f"{where}: only per-tensor KV cache scales are supported by llmq")

    def scheme_for(self, module: str) -> LinearScheme | None:
        if any(_matches(target, module) for target in self.ignore):
            return None
        # Exact names win over regexes, which win over class names (compressed-tensors' rule).
        for rank in (_is_exact, _is_regex, _is_class):
            for targets, scheme in self.groups:
                if any(rank(t) and _matches(t, module) for t in targets):
                    return scheme
        return None

    def read_state(self, ckpt: Checkpoint, prefix: str) -> dict[str, Tensor]:
        """The float state dict under `prefix`, quantized linears dequantized (float32)."""
        state: dict[str, Tensor] = {}
        schemes: dict[str, LinearScheme | None] = {}
        pending: dict[str, tuple[LinearScheme, dict[str, Tensor]]] = {}
        for name in ckpt.names_with_prefix(prefix):
            module, _, leaf = name.rpartition(".")
            if module not in schemes:
                quantized = ckpt.has(f"{module}.weight_scale")
                schemes[module] = self.scheme_for(module) if quantized else None
            scheme = schemes[module]
            if scheme is not None and (leaf in _COMPRESSED_SUFFIXES or leaf == "weight"):
                pending.setdefault(module, (scheme, {}))[1][leaf] = ckpt.read(name)
            elif leaf not in _SCALE_LEAVES:
                state[name[len(prefix) :]] = ckpt.read(name)
        for module, (scheme, tensors) in pending.items():
            state[f"{module[len(prefix) :]}.weight"] = decompress(tensors, scheme.weights)
        return state

    def activation_schemes(
        self, ckpt: Checkpoint, prefix: str
    ) -> dict[str, tuple[QuantArgs, Tensor | None]]:
        """Linears under `prefix` (names relative to it) whose inputs are quantized at run time:
        their arguments and, for static ones, the stored input_scale (NVFP4's: its stored
        input_global_scale)."""
        out: dict[str, tuple[QuantArgs, Tensor | None]] = {}
        for name in ckpt.names_with_prefix(prefix):
            if name.endswith(".weight_scale"):
                module = name.removesuffix(".weight_scale")
                scheme = self.scheme_for(module)
                if scheme is not None and scheme.input_activations is not None:
                    args = scheme.input_activations
                    calibrated = args.dynamic is not True  # static, or NVFP4's global scale
                    scale = (
                        self._stored(ckpt, f"{module}.{input_scale_name(args)}")
                        if calibrated
                        else None
                    )
                    out[module[len(prefix) :]] = (args, scale)
        return out

    def kv_quantizer(self, ckpt: Checkpoint, attention: str) -> KVQuantizer | None:
        """Quantize-dequantize of the keys and values of module `attention` (its stored
        k_scale / v_scale), or None when the checkpoint's cache is not quantized."""
        if self.kv_cache is None:
            return None
        scales = {leaf: self._stored(ckpt, f"{attention}.{leaf}") for leaf in KV_SCALE_NAMES}
        return KVQuantizer(self.kv_cache, **scales)

    @staticmethod
    def _stored(ckpt: Checkpoint, name: str) -> Tensor:
        if not ckpt.has(name):
            raise InputError(f"{ckpt.path}: {name} is missing", hint="the checkpoint is incomplete")
        return ckpt.read(name).float().reshape(1)


def _mxfp4_release_view(layout: DecoderLayout) -> dict[str, Any]:
    """A GPT-OSS MXFP4 release's config as the compressed-tensors config it amounts to: its
    experts' linears mxfp4a16 (the checkpoint shows them per expert as mxfp4-pack-quantized
    tensors, llmq.io.fused_experts), everything else in 16 bits."""
    experts = layout.experts
    assert experts is not None
    targets = [config_target(experts.linear(role)) for role in ROLES]
    fmt = PackFormat.MXFP4_PACK_QUANTIZED
    return quantization_config(
        [(get_scheme("mxfp4a16").weights, None, targets)], ignore=[], fmt=fmt
    )  # type: ignore[list-item]


def _is_exact(target: str) -> bool:
    return not target.startswith("re:") and target != "Linear"


def _is_regex(target: str) -> bool:
    return target.startswith("re:")


def _is_class(target: str) -> bool:
    return target == "Linear"
