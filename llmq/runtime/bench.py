"""`llmq bench`: quantized linears and the whole quantized model against the same weights in
16-bit (float32 on the CPU), in one run.

Per layer shape: the quantized kernel's time (activation quantization included) and the dense
`x @ W^T` time on the dequantized weight, their ratio, and the fraction of the memory roofline
the kernel reaches (bytes it must move / time / read bandwidth measured in the same run).
End to end: prefill and batch-1 greedy decode tokens/s of the quantized model and of its
dequantized twin. Without a GPU the torch reference path is what gets timed, and the report
says so.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from llmq.config import QuantArgs, Scheme
from llmq.errors import InputError
from llmq.pack.format import PackFormat, compress
from llmq.pack.reader import LinearScheme
from llmq.progress import NO_PROGRESS, Progress
from llmq.quant.primitives import quantize_weight
from llmq.runtime.generate import GraphCaptureError, graphed_greedy_decode, greedy_decode
from llmq.runtime.load import Kernel, kernel_for, quantized_linear
from llmq.runtime.modules import QuantizedLinear
from llmq.runtime.timing import copies_for, median_seconds, read_bandwidth

SYNTHETIC_STD = 0.02  # W ~ N(0, 0.02^2), x ~ N(0, 1): the baselines' data


@dataclass(frozen=True, slots=True)
class Shape:
    m: int
    n: int
    k: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """'MxNxK' (y[M, N] = x[M, K] @ W[N, K]^T)."""
        try:
            m, n, k = (int(part) for part in text.lower().split("x"))
        except ValueError:
            raise InputError(f"shape {text!r}: expected MxNxK, e.g. 1x4096x4096") from None
        if min(m, n, k) < 1:
            raise InputError(f"shape {text!r}: every dimension must be at least 1")
        return cls(m, n, k)

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


@dataclass(frozen=True, slots=True)
class ShapeTiming:
    kernel: str  # e.g. "w4a16 g128", "w8a8 int8", "w8a8 fp8"
    shape: str
    layers: int  # how many of the model's linears have this shape (0 for --shapes)
    example: str  # one of them ("" for --shapes)
    quantized_us: float
    dense_us: float
    speedup: float  # dense / quantized
    roofline: float  # (bytes the quantized kernel moves / its time) / measured read bandwidth


@dataclass(frozen=True, slots=True)
class EndToEnd:
    prompt_tokens: int
    new_tokens: int
    quantized_prefill_tps: float
    dense_prefill_tps: float
    quantized_decode_tps: float  # eager: every kernel launched from Python, as transformers runs
    dense_decode_tps: float
    # on a GPU, decode steps replayed from a CUDA graph (as serving engines run them); None on
    # the CPU, or with the reason in graph_note when the capture failed
    quantized_graph_decode_tps: float | None = None
    dense_graph_decode_tps: float | None = None
    graph_note: str | None = None

    @property
    def decode_speedup(self) -> float:
        return self.quantized_decode_tps / self.dense_decode_tps

    @property
    def graph_decode_speedup(self) -> float | None:
        if self.quantized_graph_decode_tps is None or self.dense_graph_decode_tps is None:
            return None
        return self.quantized_graph_decode_tps / self.dense_graph_decode_tps

    @property
    def prefill_speedup(self) -> float:
        return self.quantized_prefill_tps / self.dense_prefill_tps


@dataclass(slots=True)
class BenchReport:
    device: str  # e.g. "NVIDIA H100 80GB HBM3" or "cpu"
    kernels: str  # "triton" or "torch"
    dense_dtype: str
    read_bandwidth_gbs: float
    note: str | None = None
    # loading the checkpoint onto the kernels: reading the shards plus the only repacking done
    # (zero points unpacked, per-tensor scales broadcast; llmq.pack.layout)
    load_seconds: float | None = None
    shapes: list[ShapeTiming] = field(default_factory=list)
    end_to_end: EndToEnd | None = None


def describe_device(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cpu_note(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    return "no GPU: timing the torch reference path on the CPU, not the Triton kernels"


def time_shape(
    module: QuantizedLinear,
    m: int,
    dtype: torch.dtype,
    bandwidth: float,
    layers: Sequence[str] = (),
) -> ShapeTiming:
    """Quantized vs dense time of one [m, K] x [N, K]^T product, inputs ~ N(0, 1); on a GPU over
    enough copies of the weights that each call reads them from memory, not from L2."""
    device = next(module.buffers()).device
    copies = [module] + [
        copy.deepcopy(module) for _ in range(copies_for(module.packed_bytes, device) - 1)
    ]
    xs = [torch.randn(m, module.in_features, device=device).to(dtype) for _ in copies]
    quantized = median_seconds(
        [functools.partial(mod.matmul, x) for mod, x in zip(copies, xs, strict=True)], device
    )
    dense_weights = [mod.dequantized_weight(dtype) for mod in copies]
    dense = median_seconds(
        [functools.partial(torch.matmul, x, w.T) for w, x in zip(dense_weights, xs, strict=True)],
        device,
    )
    activation_bytes = m * (module.in_features + module.out_features) * xs[0].element_size()
    return ShapeTiming(
        kernel=module.label,
        shape=str(Shape(m, module.out_features, module.in_features)),
        layers=len(layers),
        example=layers[0] if layers else "",
        quantized_us=quantized * 1e6,
        dense_us=dense * 1e6,
        speedup=dense / quantized,
        roofline=(module.packed_bytes + activation_bytes) / quantized / bandwidth,
    )


def model_shapes(model: nn.Module) -> dict[tuple[str, int, int], list[str]]:
    """The quantized linears of `model`, grouped by (kernel label, N, K)."""
    groups: dict[tuple[str, int, int], list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            key = (module.label, module.out_features, module.in_features)
            groups.setdefault(key, []).append(name)
    return groups


def end_to_end(
    quantized: nn.Module, dense: nn.Module, *, prompt_tokens: int, new_tokens: int, seed: int = 0
) -> EndToEnd:
    """Prefill tokens/s (one forward over the prompt) and batch-1 greedy decode tokens/s of both
    models on the same random prompt, timed only after both have run the whole decode once.
    The warm-up must cover every step, not just the first: some work is done once per key
    length and cached process-wide (the profile shows cuDNN's SDPA), so whichever model decodes
    first pays for it at every step and the second gets it free. On an H100 that order effect
    alone made a quantized model look 11x slower than its dense twin (38.5 vs 3.5 ms a step).
    On a GPU the decode is also timed replayed from a CUDA graph (`graphed_greedy_decode`):
    eager decode of a small model is bound by kernel launches, which graphs remove."""
    generator = torch.Generator().manual_seed(seed)
    vocab = quantized.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_tokens), generator=generator)
    for model in (quantized, dense):
        greedy_decode(model, prompt, max_new_tokens=new_tokens)
    rates = []
    for model in (quantized, dense):
        run = greedy_decode(model, prompt, max_new_tokens=new_tokens)
        rates.append((prompt_tokens / run.prefill_seconds, run.decode_tokens_per_second))
    (q_prefill, q_decode), (d_prefill, d_decode) = rates
    eager = EndToEnd(prompt_tokens, new_tokens, q_prefill, d_prefill, q_decode, d_decode)
    if next(quantized.parameters()).device.type != "cuda":
        return eager
    try:
        graphed = [graph_decode_rate(m, prompt, new_tokens) for m in (quantized, dense)]
    except GraphCaptureError as exc:
        return dataclasses.replace(eager, graph_note=f"CUDA graph decode failed: {exc}")
    return dataclasses.replace(
        eager, quantized_graph_decode_tps=graphed[0], dense_graph_decode_tps=graphed[1]
    )


def graph_decode_rate(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """Decode tokens/s with steps replayed from a CUDA graph, after one warm-up run."""
    graphed_greedy_decode(model, prompt, max_new_tokens=new_tokens)
    return graphed_greedy_decode(model, prompt, max_new_tokens=new_tokens).decode_tokens_per_second


def synthetic_linear(
    shape: Shape, scheme: Scheme, device: torch.device, dtype: torch.dtype, triton: bool
) -> QuantizedLinear:
    """A quantized linear [N, K] of W ~ N(0, 0.02^2), quantized by llmq's own primitives and
    packed exactly as `llmq quantize` writes it."""
    args: QuantArgs = scheme.weights
    if args.group_size is not None and shape.k % args.group_size:
        raise InputError(
            f"shape {shape}: K = {shape.k} is not a multiple of the group size {args.group_size}"
        )
    kernel: Kernel = kernel_for(scheme.name, LinearScheme(args, scheme.input_activations))
    weight = torch.randn(shape.n, shape.k, device=device) * SYNTHETIC_STD  # quantized there
    tensors = compress(quantize_weight(weight, args), PackFormat(scheme.format))
    return quantized_linear(tensors, kernel, args, device, dtype, triton)


def _report(device: torch.device, dtype: torch.dtype, triton: bool) -> BenchReport:
    return BenchReport(
        device=describe_device(device),
        kernels="triton" if triton else "torch",
        dense_dtype=str(dtype).removeprefix("torch."),
        read_bandwidth_gbs=read_bandwidth(device) / 1e9,
        note=cpu_note(device),
    )


def bench_model(
    quantized: nn.Module,
    dense: nn.Module,
    *,
    batch_sizes: list[int],
    prompt_tokens: int,
    new_tokens: int,
    dtype: torch.dtype,
    triton: bool,
    progress: Progress = NO_PROGRESS,
) -> BenchReport:
    """Every distinct quantized layer shape of `quantized` at each M in `batch_sizes`, then end
    to end against `dense` (the same weights, dequantized, in `dtype`)."""
    device = next(quantized.parameters()).device
    report = _report(device, dtype, triton)
    shapes = model_shapes(quantized)
    with progress.stage("timing layer shapes", total=len(shapes) * len(batch_sizes)) as advance:
        for names in shapes.values():
            module = quantized.get_submodule(names[0])
            for m in batch_sizes:
                timing = time_shape(module, m, dtype, report.read_bandwidth_gbs * 1e9, names)
                report.shapes.append(timing)
                advance(1)
    with progress.stage("timing prefill and decode"):
        report.end_to_end = end_to_end(
            quantized, dense, prompt_tokens=prompt_tokens, new_tokens=new_tokens
        )
    return report


def bench_shapes(
    shapes: list[Shape],
    scheme: Scheme,
    *,
    device: torch.device,
    dtype: torch.dtype,
    triton: bool,
    progress: Progress = NO_PROGRESS,
) -> BenchReport:
    """Synthetic layers of the given shapes and scheme, quantized vs dense."""
    report = _report(device, dtype, triton)
    with progress.stage("timing shapes", total=len(shapes)) as advance:
        for shape in shapes:
            module = synthetic_linear(shape, scheme, device, dtype, triton)
            report.shapes.append(
                time_shape(module, shape.m, dtype, report.read_bandwidth_gbs * 1e9)
            )
            advance(1)
    return report
