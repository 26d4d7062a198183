"""Load an llmq (compressed-tensors) checkpoint as a transformers model that runs its quantized
linears on llmq's kernels: `load_quantized`. And its float twin, `load_dequantized`, the
reference every kernel path is compared with.

The skeleton is built on the meta device; quantized linears are swapped for `W4A16Linear` /
`W8A8Linear` holding the packed tensors as stored (zero points unpacked, per-tensor scales
broadcast: see llmq.pack.layout), and every other tensor is assigned from the memory-mapped
shards, so loading never materializes a float copy of a quantized weight.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor, nn

from llmq.calib.experts import unfuse_experts
from llmq.calib.stream import embedding_scale, resolve_device
from llmq.config import QuantArgs
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.kernels.ops import check_triton_usable
from llmq.pack.format import decompress_scale, unpack_int32
from llmq.pack.layout import W4A16Weight, W8A8Weight
from llmq.pack.reader import LinearScheme, QuantizedView
from llmq.quant.floats import effective_scale
from llmq.quant.primitives import fake_quantize
from llmq.runtime.modules import QuantizedLinear, W4A16Linear, W8A8Linear

KernelChoice = Literal["auto", "triton", "torch"]
KERNEL_CHOICES: tuple[KernelChoice, ...] = ("auto", "triton", "torch")
Kernel = Literal["w4a16", "w8a8"]
SUPPORTED = (
    "W4A16 (int4 per group or per channel, symmetric or asymmetric, act-order g_idx; FP4 "
    "weights of NVFP4A16 and MXFP4A16), "
    "W8A8-INT8 and FP8 (per-channel or per-tensor weights; activations dynamic per token or "
    "static per tensor)"
)


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on a GPU (what the kernels are built for), float32 on the CPU (as `llmq eval`)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def kernel_for(module: str, scheme: LinearScheme) -> Kernel:
    """Which kernel runs `module`, or a clear error naming the scheme that has none."""
    w, a = scheme.weights, scheme.input_activations
    if w.type == "int" and w.num_bits == 4 and w.strategy in ("group", "channel") and a is None:
        return "w4a16"
    if w.type == "float" and w.num_bits == 4 and a is None:  # NVFP4A16, MXFP4A16: E2M1 codes
        return "w4a16"
    eight_bit = w.num_bits == 8 and w.symmetric and w.strategy in ("channel", "tensor")
    per_token = a is not None and a.strategy == "token" and a.dynamic
    static = a is not None and a.strategy == "tensor" and not a.dynamic
    if eight_bit and a is not None and a.type == w.type and a.symmetric and (per_token or static):
        return "w8a8"
    acts = "float" if a is None else f"{a.label} {a.timing}"
    raise InputError(
        f"{module}: no llmq kernel for weights {w.label}, activations {acts}",
        hint=f"kernels exist for {SUPPORTED}; `llmq eval` simulates every scheme",
    )


def use_triton(kernels: KernelChoice, device: torch.device) -> bool:
    if kernels == "torch":
        return False
    if kernels == "triton" or device.type == "cuda":
        check_triton_usable(device)
        return True
    return False


def _skeleton(ckpt: Checkpoint, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ckpt.model_config(), dtype=dtype)
    unfuse_experts(model, ckpt.layout)
    return model


def _finish(
    model: nn.Module, ckpt: Checkpoint, state: dict[str, Tensor], device: torch.device
) -> nn.Module:
    """Assign `state` (strictly: every other tensor must already be real), rebuild the rotary
    embedding (its buffers are computed, not stored) and tie the embeddings."""
    if ckpt.tied_embeddings:
        state[f"{ckpt.layout.lm_head}.weight"] = state[f"{ckpt.layout.embed}.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if model.get_parameter_or_buffer(k).is_meta]
    if missing or unexpected:
        names = ", ".join((missing or unexpected)[:3])
        what = "missing from" if missing else "not expected in"
        raise InputError(f"{ckpt.path}: tensors {what} the checkpoint: {names}")
    rotary = model.get_submodule(ckpt.layout.rotary)
    model.set_submodule(ckpt.layout.rotary, type(rotary)(model.config).to(device))
    _compute_embedding_scale(model, device)
    model.tie_weights()
    return model.eval()


def _compute_embedding_scale(model: nn.Module, device: torch.device) -> None:
    """Gemma's embedding scale (sqrt(hidden)) is a buffer no checkpoint stores: built on the
    meta device with the skeleton, it is set from the module's own float."""
    for module in model.modules():
        scale = embedding_scale(module)
        if scale is not None and module.embed_scale.is_meta:
            module.embed_scale = torch.tensor(scale, device=device)


def load_dequantized(ckpt: Checkpoint, *, quantize_inputs: bool = False) -> nn.Module:
    """A float32 transformers model with every quantized weight dequantized: the reference for
    comparisons. With `quantize_inputs`, linears whose scheme quantizes their inputs get them
    fake-quantized (as `llmq eval` simulates them); otherwise inputs stay float."""
    view = QuantizedView(ckpt)
    model = _skeleton(ckpt, torch.float32)
    state = {k: v.to(torch.float32) for k, v in view.read_state(ckpt, "").items()}
    model = _finish(model, ckpt, state, torch.device("cpu"))
    if quantize_inputs:
        for module, (args, scale) in view.activation_schemes(ckpt, "").items():
            hook = functools.partial(_fake_quantize_input, args=args, scale=scale)
            model.get_submodule(module).register_forward_pre_hook(hook)
    return model


def _fake_quantize_input(
    _module: nn.Module, inputs: tuple[Tensor, ...], *, args: QuantArgs, scale: Tensor | None
) -> tuple[Tensor, ...]:
    return (fake_quantize(inputs[0], args, scale), *inputs[1:])


W4A16_SUFFIXES = (
    "weight_packed",
    "weight_shape",
    "weight_scale",
    "weight_zero_point",
    "weight_g_idx",
    "weight_global_scale",
)
W8A8_SUFFIXES = ("weight", "weight_scale", "input_scale")


def w4a16_weight(tensors: dict[str, Tensor], args: QuantArgs) -> W4A16Weight:
    """The kernel's view of one pack-quantized linear's on-disk tensors (keyed by suffix)."""
    if args.type == "float":
        return _fp4_weight(tensors, args)
    out_features, in_features = (int(d) for d in tensors["weight_shape"].tolist())
    scale = tensors["weight_scale"]
    zero = tensors.get("weight_zero_point")
    if zero is not None:
        zero = unpack_int32(zero, 4, (out_features, scale.shape[1]), packed_dim=0)
    g_idx = tensors.get("weight_g_idx")
    return W4A16Weight(
        packed=tensors["weight_packed"],
        scale=scale,
        zero=zero,
        g_idx=None if g_idx is None else g_idx.to(torch.int32),
        in_features=in_features,
        group_size=args.group_size or in_features,
    )


def _fp4_weight(tensors: dict[str, Tensor], args: QuantArgs) -> W4A16Weight:
    """NVFP4 / MXFP4 weights for the W4A16 kernel: the packed bytes read as int32 words, the
    effective scale per group (float32; exact in bfloat16 for llmq's power-of-two global)."""
    packed = tensors["weight_packed"]
    held = decompress_scale(tensors["weight_scale"], args)
    scale = effective_scale(held, tensors.get("weight_global_scale"))
    return W4A16Weight(
        packed=packed.contiguous().view(torch.int32), scale=scale, zero=None, g_idx=None,
        in_features=packed.shape[1] * 2, group_size=int(args.group_size or 0), fp4=True,
    )  # fmt: skip


def w8a8_weight(tensors: dict[str, Tensor]) -> W8A8Weight:
    """The kernel's view of one int-quantized or float-quantized linear: per-channel scales."""
    codes = tensors["weight"]
    scale = tensors["weight_scale"].float().reshape(-1)
    static = tensors.get("input_scale")
    return W8A8Weight(
        codes=codes,
        scale=scale.expand(codes.shape[0]).contiguous(),
        input_scale=None if static is None else static.float().reshape(1),
    )


def quantized_linear(
    tensors: dict[str, Tensor],
    kernel: Kernel,
    args: QuantArgs,
    device: torch.device,
    dtype: torch.dtype,
    triton: bool,
) -> QuantizedLinear:
    """A runtime module from one linear's on-disk tensors; scales in the compute dtype."""
    bias = tensors.get("bias")
    bias = None if bias is None else bias.to(device, dtype)
    if kernel == "w4a16":
        weight = w4a16_weight(tensors, args).to(device, dtype)
        return W4A16Linear(weight.k_major() if triton else weight, bias, triton=triton)
    return W8A8Linear(w8a8_weight(tensors).to(device), bias, triton=triton)


def _read_linear(ckpt: Checkpoint, module: str, kernel: Kernel) -> dict[str, Tensor]:
    suffixes = (*(W4A16_SUFFIXES if kernel == "w4a16" else W8A8_SUFFIXES), "bias")
    return {s: ckpt.read(f"{module}.{s}") for s in suffixes if ckpt.has(f"{module}.{s}")}


def quantized_modules(ckpt: Checkpoint, view: QuantizedView) -> dict[str, LinearScheme]:
    """The linears stored quantized (they have a weight_scale and match a config group)."""
    found = {}
    for name in ckpt.tensors:
        if name.endswith(".weight_scale"):
            module = name.removesuffix(".weight_scale")
            if (scheme := view.scheme_for(module)) is not None:
                found[module] = scheme
    return found


def load_quantized(
    ckpt: Checkpoint,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    kernels: KernelChoice = "auto",
) -> nn.Module:
    """The checkpoint as a transformers causal LM whose quantized linears run llmq's kernels.

    kernels: "auto" runs Triton on a GPU and the torch reference on the CPU; "triton" forces the
    Triton kernels (on the CPU only under TRITON_INTERPRET=1); "torch" forces the reference.
    """
    view = QuantizedView(ckpt)
    if view.kv_cache is not None:
        raise InputError(
            f"{ckpt.path}: its KV cache is quantized ({view.kv_cache.label}); no llmq kernel runs "
            "a quantized cache yet",
            hint="`llmq eval` simulates it; vLLM runs it",
        )
    schemes = quantized_modules(ckpt, view)
    if not schemes:
        raise InputError(f"{ckpt.path}: no quantized linears", hint="quantize it with llmq first")
    for module, scheme in schemes.items():
        kernel_for(module, scheme)  # fail before reading anything
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    triton = use_triton(kernels, device)
    model = _skeleton(ckpt, dtype)
    for module, scheme in schemes.items():
        kernel = kernel_for(module, scheme)
        tensors = _read_linear(ckpt, module, kernel)
        linear = quantized_linear(tensors, kernel, scheme.weights, device, dtype, triton)
        model.set_submodule(module, linear)
    state = {}
    for name, tensor_info in ckpt.tensors.items():
        if name.rpartition(".")[0] not in schemes:
            tensor = ckpt.read(name)
            floating = tensor_info.dtype in ("F64", "F32", "F16", "BF16")
            state[name] = tensor.to(device, dtype) if floating else tensor.to(device)
    return _finish(model, ckpt, state, device)


def kernels_in_use(model: nn.Module) -> str:
    """ "triton" or "torch": what the quantized linears of a `load_quantized` model run."""
    linear = next(m for m in model.modules() if isinstance(m, QuantizedLinear))
    return "triton" if linear.triton else "torch"
