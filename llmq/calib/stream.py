"""LayerStream: run a decoder-only model one layer at a time, never holding the whole model.

The skeleton is built on the meta device (no memory); each decoder layer is materialized from
the memory-mapped shards when it is needed and dropped afterwards. Every pipeline in llmq
(calibration, quantization, evaluation, structured scoring) walks a model through this one
class, in one loop: `LayerStream.walk` (llmq.calib.walk).
"""

from __future__ import annotations

import copy
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from llmq.calib.attention import (
    blocked_causal_applies,
    causal_attention,
    causal_mask,
    gpu_causal_applies,
    gpu_causal_attention,
    needs_eager,
    needs_explicit_mask,
)
from llmq.calib.experts import ExpertTokens, unfuse_experts
from llmq.calib.norm import fuse_rms_norms
from llmq.calib.walk import H, LayerWalk
from llmq.errors import InputError
from llmq.io.checkpoint import Checkpoint
from llmq.io.layout import DecoderLayout
from llmq.processes import SINGLE_PROCESS, Processes
from llmq.progress import NO_PROGRESS, Progress

StateLoader = Callable[[Checkpoint, str], dict[str, Tensor]]
"""Reads the float state dict of one module prefix (e.g. "model.layers.3.") from a checkpoint."""
BlockOutput = Callable[[slice], Tensor]
"""A residual block's output for some samples of the batch, standing in for running the block."""
KVHook = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""(keys, values) after the rotary embedding, as the KV cache stores them -> what attention reads."""

ACTIVATION_DTYPE = torch.float32
ATTENTION_IMPLEMENTATION = "llmq_attention"  # no "sdpa" in it: transformers would refuse Gemma 2
_KV_HOOK = "_llmq_kv_hook"


def _attention_with_kv_hook(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> Any:
    """PyTorch SDPA attention (transformers' own) with the keys and values first passed through
    the attention module's KV hook, if one is set: where the KV cache is quantized. Unmasked
    causal windows of CPU passes take `causal_attention` where it is the faster one; layer
    passes call with no mask, so a sliding window shorter than the keys gets its mask here, and
    capped logits (Gemma 2) and attention sinks (GPT-OSS) the family's own eager attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hook = getattr(module, _KV_HOOK, None)
    if hook is not None:
        key, value = hook(key, value)
    if blocked_causal_applies(module, query, key, attention_mask, kwargs):
        return causal_attention(query, key, value, kwargs["scaling"]), None
    if attention_mask is None and needs_explicit_mask(query, key, kwargs):
        attention_mask = causal_mask(query, key, kwargs.get("sliding_window"))
    if gpu_causal_applies(module, query, key, attention_mask, kwargs):
        return gpu_causal_attention(query, key, value, kwargs.get("scaling")), None
    if needs_eager(kwargs):  # capped logits (Gemma 2), sinks (GPT-OSS): SDPA cannot
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def embedding_scale(embedding: nn.Module) -> float | None:
    """The factor a family's embedding module multiplies its lookups by (Gemma's sqrt(hidden),
    held as a float beside a buffer no checkpoint stores); None for a plain embedding."""
    return getattr(embedding, "scalar_embed_scale", None)


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _attention_with_kv_hook)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None or "auto": the GPU when there is one, else the CPU. A GPU asked for but absent is
    bad input, not a silent fallback."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise InputError(
            f"--device {device!r}: not a device", hint="auto, cpu, cuda or cuda:N"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: no CUDA GPU is available", hint="use --device cpu")
    return resolved


def read_plain_state(ckpt: Checkpoint, prefix: str) -> dict[str, Tensor]:
    """The tensors under `prefix`, as stored (an unquantized checkpoint)."""
    return {name[len(prefix) :]: ckpt.read(name) for name in ckpt.names_with_prefix(prefix)}


class LayerStream:
    """Embeddings, decoder layers and the LM head of one checkpoint, materialized on demand."""

    def __init__(
        self,
        ckpt: Checkpoint,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = ACTIVATION_DTYPE,
        state_loader: StateLoader = read_plain_state,
        batch_size: int = 4,
        expert_tokens: ExpertTokens = "all",
        processes: Processes = SINGLE_PROCESS,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.ckpt = ckpt
        # the processes that share the calibration windows: statistics are reduced over them
        self.processes = processes
        # which linears share an input: an expert's alone when it sees only its routed tokens
        self.layout = ckpt.layout if expert_tokens == "all" else ckpt.layout.expert_groups_split()
        # each materialized layer's index and own layout (a mixture of experts may have dense
        # layers)
        self._loaded: weakref.WeakKeyDictionary[nn.Module, tuple[int, DecoderLayout]] = (
            weakref.WeakKeyDictionary()
        )
        self.device = resolve_device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self._load_state = state_loader
        self.config = ckpt.model_config()
        register_attention()
        with torch.device("meta"):
            self._skeleton = AutoModelForCausalLM.from_config(
                self.config, attn_implementation=ATTENTION_IMPLEMENTATION
            )
        unfuse_experts(self._skeleton, self.layout, expert_tokens)
        rotary_meta = self._skeleton.get_submodule(self.layout.rotary)
        self._rotary = type(rotary_meta)(self._skeleton.config).to(self.device)
        # Gemma 3 keeps one rotary table per attention type (sliding layers use another base)
        self._rotary_by_layer_type = (
            "layer_type" in inspect.signature(self._rotary.forward).parameters
        )
        self._embed_scale = embedding_scale(self._skeleton.get_submodule(self.layout.embed))
        self._logit_softcap = getattr(self.config, "final_logit_softcapping", None)

    @property
    def num_layers(self) -> int:
        return self.ckpt.num_layers

    def _read_state(self, prefix: str) -> dict[str, Tensor]:
        """The tensors under `prefix` on the stream's device, in its compute dtype.

        Tensors read from a shard are views of its memory map, and every page read through an
        open handle stays resident: with the handles kept, RSS would grow by each layer read,
        to the whole checkpoint. Closed after each read, only live tensors hold mapped pages.
        """
        state = {
            key: tensor.to(device=self.device, dtype=self.dtype)
            for key, tensor in self._load_state(self.ckpt, prefix).items()
        }
        self.ckpt.close()
        return state

    def _materialize(self, module_name: str, prefix: str) -> nn.Module:
        module = copy.deepcopy(self._skeleton.get_submodule(module_name))
        module.load_state_dict(self._read_state(prefix), strict=True, assign=True)
        return fuse_rms_norms(module.eval())

    def load_layer(self, index: int) -> nn.Module:
        """Decoder layer `index`, materialized on the stream's device in its compute dtype."""
        prefix = self.layout.layer_prefix(index)
        layer = self._materialize(prefix.rstrip("."), prefix)
        self._loaded[layer] = (index, self.layout.at(index))
        return layer

    def layout_of(self, layer: nn.Module) -> DecoderLayout:
        """The layout of a layer `load_layer` materialized: its linears, groups and pairings."""
        return self._loaded[layer][1]

    def walk(
        self, hidden: H, *, start: int = 0, progress: Progress = NO_PROGRESS, label: str = "layers"
    ) -> LayerWalk[H]:
        """The decoder layers from `start` on, one at a time, the first taking `hidden`
        [samples, seq, hidden] (None: a data-free walk) as input (`LayerWalk`)."""
        return LayerWalk(self, hidden, start=start, progress=progress, label=label)

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings [batch, seq, hidden]; the table is read, used and dropped."""
        weight = self._read_weight(self.layout.embed)
        embedded = nn.functional.embedding(input_ids.to(self.device), weight)
        if self._embed_scale is not None:  # rounded to the weights' dtype, as transformers does
            embedded = embedded * torch.tensor(self._embed_scale).to(weight.dtype)
        return embedded

    def _read_weight(self, module: str) -> Tensor:
        return self._read_state(f"{module}.")["weight"]

    def position_embeddings(self, layer: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of the rotary embedding for `layer` (its attention type's, where the
        family keeps one table per type)."""
        positions = torch.arange(hidden.shape[1], device=self.device).unsqueeze(0)
        if self._rotary_by_layer_type:
            layer_type = self.config.layer_types[self._loaded[layer][0]]
            return self._rotary(hidden, positions, layer_type)
        return self._rotary(hidden, positions)

    def batches(self, hidden: Tensor) -> Iterator[slice]:
        for start in range(0, hidden.shape[0], self.batch_size):
            yield slice(start, min(start + self.batch_size, hidden.shape[0]))

    @torch.inference_mode()
    def run_layer(
        self,
        layer: nn.Module,
        hidden: Tensor,
        *,
        on_batch: Callable[[], Any] | None = None,
        keep: int | None = None,
        in_place: bool = False,
        replace: dict[str, BlockOutput] | None = None,
    ) -> Tensor:
        """Apply one decoder layer to `hidden` [samples, seq, hidden], in micro-batches.

        Attention is causal: with no mask, SDPA applies its own causal masking, which is exact
        for unpadded windows of equal length (all llmq calibration and evaluation windows).

        Activations are the largest thing the pipeline holds (128 x 512 tokens of a 70B model
        are 2 GB a copy), so callers say what they need: `keep` returns only the first `keep`
        samples' outputs (the rest run for the input hooks' sake, and stop once the layer's
        last linear has seen its input: its product would be thrown away), `in_place` writes
        the outputs over `hidden` when the caller has no further use for the inputs.
        `replace` maps blocks (`layout.blocks`) to outputs already computed, which the layer
        uses instead of running them.
        """
        if in_place and keep is not None:
            raise ValueError("run_layer: keep and in_place exclude each other")
        kept = hidden.shape[0] if keep is None else min(keep, hidden.shape[0])
        out = hidden if in_place else torch.empty_like(hidden[:kept])
        last_linear = self.layout_of(layer).linears[-1]
        for rows, result in self._forward(layer, hidden, replace, stop=last_linear, after=kept):
            if rows.start < kept:
                result = result[0] if isinstance(result, tuple) else result
                stored = min(rows.stop, kept) - rows.start
                out[rows.start : rows.start + stored] = result[:stored]
            if on_batch is not None:
                on_batch()
        return out

    @torch.inference_mode()
    def run_until(
        self,
        layer: nn.Module,
        hidden: Tensor,
        module: str,
        *,
        replace: dict[str, BlockOutput] | None = None,
        on_batch: Callable[[], Any] | None = None,
    ) -> None:
        """Run `layer` on `hidden` up to `module`, for the input hooks' sake: they see its
        input, and nothing after it runs. `replace`: as in `run_layer`."""
        for _ in self._forward(layer, hidden, replace, stop=module, after=0):
            if on_batch is not None:
                on_batch()

    def _forward(
        self,
        layer: nn.Module,
        hidden: Tensor,
        replace: dict[str, BlockOutput] | None,
        *,
        stop: str,
        after: int,
    ) -> Iterator[tuple[slice, Any]]:
        """(rows, the layer's output on them) per micro-batch; batches from sample `after` on
        stop before module `stop` and give None."""
        position_embeddings = self.position_embeddings(layer, hidden[:1])
        stop_module = layer.get_submodule(stop)
        for rows in self.batches(hidden):
            stopping = rows.start >= after
            result = None
            with (
                self._answering(layer, replace or {}, rows),
                _stop_before(stop_module) if stopping else nullcontext(),
            ):
                result = layer(
                    hidden[rows], attention_mask=None, position_embeddings=position_embeddings
                )
            yield rows, result

    @contextmanager
    def _answering(
        self, layer: nn.Module, replace: dict[str, BlockOutput], rows: slice
    ) -> Iterator[None]:
        """Blocks of `replace` return their given output for `rows` instead of running, and the
        norm in front of each passes its input through: nothing reads its output. (A staged
        GPTQ layer ran 8 norms per micro-batch, 4 of them for nothing: ~1.5% of its time.)"""
        modules = []
        try:
            for name, output in replace.items():
                value = output(rows)
                answer = (value, None) if name == self.layout.attention else value
                module = layer.get_submodule(name)
                module.forward = lambda *_args, _answer=answer, **_kwargs: _answer
                modules.append(module)
                norm = self.layout_of(layer).norm_before(name)
                if norm is not None:
                    skipped = layer.get_submodule(norm)
                    skipped.forward = lambda hidden, *_args, **_kwargs: hidden
                    modules.append(skipped)
            yield
        finally:
            for module in modules:
                del module.forward

    def head(self) -> tuple[nn.Module, Tensor]:
        """The final norm and the output projection's weight (the embedding's when tied)."""
        norm = self._materialize(self.layout.final_norm, f"{self.layout.final_norm}.")
        head_name = self.layout.embed if self.ckpt.tied_embeddings else self.layout.lm_head
        return norm, self._read_weight(head_name)

    @torch.inference_mode()
    def log_probs(self, hidden: Tensor) -> Tensor:
        """Next-token log-probabilities [samples, seq, vocab] in float32 from the last layer's
        output, one sample at a time (logits are vocab-wide)."""
        norm, head = self.head()
        return torch.stack(
            [torch.log_softmax(self.logits(norm, head, row).float(), dim=-1) for row in hidden]
        )

    def logits(self, norm: nn.Module, head: Tensor, hidden: Tensor) -> Tensor:
        """The LM head's logits, capped where the family caps them (Gemma 2: c · tanh(x / c))."""
        logits = norm(hidden) @ head.T
        if self._logit_softcap is None:
            return logits
        return torch.tanh(logits / self._logit_softcap) * self._logit_softcap

    @torch.inference_mode()
    def token_nll(self, hidden: Tensor, input_ids: Tensor) -> tuple[float, int]:
        """Sum of next-token negative log-likelihoods (float64) and the number of tokens scored."""
        norm, head = self.head()
        total, count = 0.0, 0
        for row in range(hidden.shape[0]):  # one window at a time: logits are vocab-wide
            logits = self.logits(norm, head, hidden[row, :-1])
            targets = input_ids[row, 1:].to(self.device)
            nll = nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
            total += float(nll.double())
            count += targets.numel()
        return total, count


class _LayerStopped(Exception):
    """Raised by `_stop_before`'s hook to end a forward pass whose output nobody reads."""


@contextmanager
def _stop_before(module: nn.Module) -> Iterator[None]:
    """End the layer's forward pass when it reaches `module`, after the hooks registered
    before this one (observation) have seen the module's input."""

    def stop(_module: nn.Module, _args: tuple[Tensor, ...]) -> None:
        raise _LayerStopped

    handle = module.register_forward_pre_hook(stop)
    try:
        yield
    except _LayerStopped:
        pass
    finally:
        handle.remove()


@contextmanager
def kv_hook(attention: nn.Module, hook: KVHook | None) -> Iterator[None]:
    """Pass the keys and values of `attention` through `hook` while the context is open."""
    if hook is None:
        yield
        return
    setattr(attention, _KV_HOOK, hook)
    try:
        yield
    finally:
        delattr(attention, _KV_HOOK)
