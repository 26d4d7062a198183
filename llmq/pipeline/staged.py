"""Quantize a layer group by group (GPTQ's true-sequential order inside a layer), in about
one forward pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from llmq.calib.collect import observe_until
from llmq.calib.stats import CalibStats
from llmq.calib.stream import (
    BlockOutput,
    LayerStream,
)
from llmq.config import Recipe
from llmq.heap import ReusedBuffers
from llmq.pack.format import scheme_format
from llmq.pipeline.linears import (
    REPORT_WINDOWS,
    LayerDone,
    compared_with_baseline,
    quantize_linears,
    relative_rmse,
    rtn_layer_error,
    rtn_linear_errors,
    rtn_weights,
)
from llmq.pipeline.plan import LinearPlan
from llmq.quant.methods import Method


class StagedLayer:
    """Quantize one layer group by group (GPTQ's true-sequential order inside a layer): each
    group of linears that share an input is observed on the output of the groups before it,
    already quantized, then quantized. The layer's output is written over `hidden`.

    With `keep`, it costs about one forward pass, against two for observe-then-propagate: each
    stage runs the layer only up to its group, blocks already quantized answer from their kept
    outputs, and the MLP's output projection runs once, in the last pass, on its kept inputs.
    The price is memory: the attention's output and the MLP's intermediate activations of all
    samples (2 + intermediate/hidden copies of the activations, with the layer's own input),
    held in `buffers` from layer to layer. Without `keep`, each stage recomputes the blocks
    before its group (about 1.5 forward passes more on a Llama layer) and only the layer's
    input is held: the same result, for a GPU whose memory the kept activations would not fit
    (`keeps_activations`).
    """

    def __init__(
        self,
        stream: LayerStream,
        layer: nn.Module,
        local: dict[str, LinearPlan],
        method: Method,
        recipe: Recipe,
        hidden: Tensor,
        on_batch: Callable[[], Any],
        buffers: ReusedBuffers | None = None,
        *,
        keep: bool = True,
    ) -> None:
        self.stream, self.layer, self.local, self.method = stream, layer, local, method
        self.keep = keep
        self.buffers = buffers or ReusedBuffers()
        self.fmt = scheme_format(recipe.scheme)
        self.hidden, self.on_batch = hidden, on_batch
        self.compare = compared_with_baseline(method, recipe.weight_args is None)
        self.kept: dict[str, BlockOutput] = {}  # blocks done: their outputs, by block
        self.done = LayerDone({}, [], hidden)

    def run(self) -> LayerDone:
        stream, layer, hidden = self.stream, self.layer, self.hidden
        reference = stream.run_layer(layer, hidden[:REPORT_WINDOWS], on_batch=self.on_batch)
        if self.compare:  # the baseline's copy of the whole layer lives only for this pass
            baseline = rtn_weights(layer, self.local, self.method.sparsity)
            self.done.rtn_error = rtn_layer_error(
                stream, layer, baseline, {}, None, hidden, reference, self.on_batch
            )
        blocks = stream.layout_of(layer).blocks
        for position, (block, groups) in enumerate(blocks):
            if not self.keep:  # later stages and the output pass recompute the block
                for group in groups:
                    self._quantize(group)
                continue
            for group in groups[:-1]:
                self._quantize(group)
            projection_input = self._quantize(groups[-1], capture=True)
            assert projection_input is not None
            projection = layer.get_submodule(groups[-1][0])
            if position < len(blocks) - 1:  # later stages read it: computed once, kept
                output = self.buffers.take(
                    f"kept {block}", (*projection_input.shape[:-1], projection.weight.shape[0]),
                    projection_input,
                )  # fmt: skip
                self.kept[block] = _kept_output(stream, projection, projection_input, output)
            else:  # only the last pass reads it
                self.kept[block] = lambda rows, x=projection_input, p=projection: p(x[rows])
            del projection_input
        stream.run_layer(layer, hidden, on_batch=self.on_batch, in_place=True, replace=self.kept)
        self.done.error = relative_rmse(hidden[:REPORT_WINDOWS], reference)
        return self.done

    def _quantize(self, group: tuple[str, ...], *, capture: bool = False) -> Tensor | None:
        """Observe the group's input on every sample (the layer run up to it), quantize its
        linears, and return its input when `capture` (a block's output projection). A group
        left entirely in full precision runs only to be captured."""
        names = [name for name in group if name in self.local]
        if not names and not capture:
            return None
        stats, captured = observe_until(
            self.stream, self.layer, names, self.hidden, names[0] if names else group[0],
            replace=self.kept, capture=capture, buffers=self.buffers, on_batch=self.on_batch,
            hessian=self.method.needs_hessian, norms=self.method.needs_norms,
        )  # fmt: skip
        part = {name: self.local[name] for name in names}
        errors: dict[str, float | None] = {}
        if self.compare:  # RTN's output error, from the weights the method is about to replace:
            # RTN runs again here (~20 ms a layer on the default model) rather than its copy of
            # the whole layer being held through every stage
            baseline = rtn_weights(self.layer, part, self.method.sparsity)
            errors = rtn_linear_errors(self.layer, baseline, stats)
        tensors, reports = quantize_linears(
            self.layer, part, stats, self.method, self.fmt, errors,
            self.stream.layout_of(self.layer), self.stream.processes,
        )  # fmt: skip
        self.done.tensors.update(tensors)
        self.done.linears.extend(reports)
        return captured


@torch.inference_mode()  # also when `StagedLayer` runs outside `_quantize_layer` (tests)
def _kept_output(
    stream: LayerStream, projection: nn.Module, inputs: Tensor, output: Tensor
) -> BlockOutput:
    """A block's output, from its output projection on the kept inputs of all samples,
    written into `output`."""
    for rows in stream.batches(inputs):
        output[rows] = projection(inputs[rows])
    return lambda rows: output[rows]


KEEP_SHARE_OF_FREE = 0.8  # the kept activations may take this much of a GPU's free memory


def keeps_activations(
    setting: str, stream: LayerStream, layer: nn.Module, hidden: Tensor, buffers: ReusedBuffers
) -> bool:
    """Whether a staged layer keeps its blocks' activations (`StagedLayer`'s `keep`): as
    `setting` says ("keep", "recompute"), or "auto": on a CPU always (host memory holds the
    model's layers far more often than it runs short), on a GPU when they fit in
    `KEEP_SHARE_OF_FREE` of its free memory, counting what `buffers` hold from the layer before
    as free."""
    if setting != "auto":
        return setting == "keep"
    if hidden.device.type != "cuda":
        return True
    free, _total = torch.cuda.mem_get_info(hidden.device)
    needed = kept_activation_bytes(stream, layer, hidden)
    return needed <= KEEP_SHARE_OF_FREE * (free + buffers.held_bytes())


def kept_activation_bytes(stream: LayerStream, layer: nn.Module, hidden: Tensor) -> int:
    """What a staged layer keeps beyond its input: the output of each block but the last, and
    the widest input of a block's output projection (captured, one at a time)."""
    projections = [
        layer.get_submodule(groups[-1][0]).weight
        for _block, groups in stream.layout_of(layer).blocks
    ]
    kept_features = sum(weight.shape[0] for weight in projections[:-1])
    captured_features = max(weight.shape[1] for weight in projections)
    tokens = hidden.shape[0] * hidden.shape[1]
    return tokens * (kept_features + captured_features) * hidden.element_size()


def stages_in_layer(
    stream: LayerStream,
    recipe: Recipe,
    method: Method,
    calib_stats: CalibStats | None,
    local: dict[str, LinearPlan],
) -> bool:
    """Whether the layer is quantized group by group (`StagedLayer`): for methods that
    observe their own Hessians (or input norms: Wanda) and quantize weights alone, unless the
    recipe turns it off.
    Scale searches (AWQ, SmoothQuant), KV cache and activation scales read the float layer's
    statistics of all groups at once; so do mixtures of experts, whose MLP output is no single
    linear's output that a stage could reuse, and layouts found from the module tree, whose
    blocks' outputs are not known to be their last linear's."""
    return (
        recipe.gptq.true_sequential
        and stream.layout.experts is None
        and not stream.layout.discovered
        and calib_stats is None
        and (method.needs_hessian or method.needs_norms)
        and method.awq is None
        and recipe.smooth is None
        and recipe.kv_cache_args is None
        and all(linear.input_args is None for linear in local.values())
    )
