"""Token perplexity of a checkpoint (float or compressed-tensors), one layer at a time.

Quantized linears are dequantized as they are loaded; linears whose scheme quantizes input
activations get them quantized per token at run time, exactly as the format specifies, so a
W8A8 or FP8 checkpoint is scored as a kernel would run it. Memory stays near one layer.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from llmq.calib.data import TokenWindows
from llmq.calib.hooks import activation_quantization
from llmq.calib.stream import LayerStream, kv_hook
from llmq.config import QuantArgs
from llmq.io.atomic import write_json
from llmq.io.cache import read_cached, write_cached
from llmq.io.checkpoint import Checkpoint
from llmq.pack.reader import QuantizedView
from llmq.progress import NO_PROGRESS, Progress

EVAL_DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class Perplexity:
    model: str
    perplexity: float
    nll_per_token: float
    tokens: int
    quantized: str  # what was simulated, e.g. "weights int4 g64; activations none"
    seconds: float
    cached: bool = False


def describe_quantization(view: QuantizedView) -> str:
    """What evaluation simulates, e.g. "W int8 channel; A int8 tensor static; KV fp8 tensor
    static" (A float: inputs not quantized; no KV part: the cache stays in full precision)."""
    if not view.groups:
        return "none (float checkpoint)"
    weights = sorted({scheme.weights.label for _, scheme in view.groups})
    acts = sorted({_timing(s.input_activations) for _, s in view.groups if s.input_activations})
    text = f"W {' + '.join(weights)}; A {' + '.join(acts) if acts else 'float'}"
    return text if view.kv_cache is None else f"{text}; KV {_timing(view.kv_cache)}"


def _timing(args: QuantArgs) -> str:
    return f"{args.label} {args.timing}"


def perplexity(
    ckpt: Checkpoint,
    windows: TokenWindows,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Perplexity:
    started = time.perf_counter()
    view = QuantizedView(ckpt)
    stream, hidden = run_checkpoint(
        ckpt, view, windows.input_ids, progress=progress, device=device,
        label=f"perplexity {ckpt.path.name}",
    )  # fmt: skip
    nll, count = stream.token_nll(hidden, windows.input_ids)
    return Perplexity(
        model=str(ckpt.path),
        perplexity=math.exp(nll / count),
        nll_per_token=nll / count,
        tokens=count,
        quantized=describe_quantization(view),
        seconds=time.perf_counter() - started,
    )


def run_checkpoint(
    ckpt: Checkpoint,
    view: QuantizedView,
    input_ids: Tensor,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
    label: str = "layers",
    simulate_activations: bool = True,
) -> tuple[LayerStream, Tensor]:
    """The last decoder layer's output on `input_ids` [samples, seq], one layer in memory at a
    time, with the checkpoint's weights dequantized and its activations and KV cache quantized
    as its format says (in float with `simulate_activations=False`: the weights alone); and the
    stream, for the head."""
    stream = LayerStream(ckpt, device=device, dtype=EVAL_DTYPE, state_loader=view.read_state)
    walk = stream.walk(stream.embed(input_ids), progress=progress, label=label)
    for layer in walk:
        inputs, kv = {}, None
        if simulate_activations:
            inputs = view.activation_schemes(ckpt, layer.prefix)
            kv = view.kv_quantizer(ckpt, layer.prefix + stream.layout.attention)
        attention = layer.module.get_submodule(stream.layout.attention)
        with activation_quantization(layer.module, inputs), kv_hook(attention, kv):
            layer.advance(stream.run_layer(layer.module, layer.hidden, in_place=True))
    return stream, walk.hidden


def cache_key(ckpt: Checkpoint, windows: TokenWindows) -> str:
    """Identifies (checkpoint files, exact windows, dtype): a cached result is reused only for
    the very same model and tokens."""
    h = hashlib.sha256(json.dumps(ckpt.file_stamps(), sort_keys=True).encode())
    h.update(windows.input_ids.numpy().tobytes())
    h.update(str(EVAL_DTYPE).encode())
    return h.hexdigest()[:32]


def cached_perplexity(
    ckpt: Checkpoint,
    windows: TokenWindows,
    cache: Path | None,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Perplexity:
    """`perplexity`, reusing an earlier result for the same checkpoint and windows."""
    if cache is None:
        return perplexity(ckpt, windows, progress=progress, device=device)
    path = cache / f"{cache_key(ckpt, windows)}.json"
    cached = read_cached(path, _load_perplexity)
    if cached is not None:
        return cached
    result = perplexity(ckpt, windows, progress=progress, device=device)
    write_cached(path, lambda partial: write_json(partial, asdict(result)))
    return result


def _load_perplexity(path: Path) -> Perplexity:
    """A cached result; ValueError when the entry is not one (wrong fields or values)."""
    data = {**json.loads(path.read_text()), "cached": True}
    result = Perplexity(**data)
    if not (isinstance(result.perplexity, float) and math.isfinite(result.perplexity)):
        raise ValueError(f"perplexity {result.perplexity!r} is not a finite number")
    return result
