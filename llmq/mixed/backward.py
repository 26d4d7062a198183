"""The language-model loss backward through a checkpoint one decoder layer at a time, for the
sensitivities that read its gradients (`gradient`, `fisher`): the memory of one layer and of
each layer's input activations whatever the model's size, where transformers' whole model in
float32 with its gradients takes about four times its float32 weights.

A forward walk keeps every layer's input (the embeddings, then each layer's output). The loss,
summed over each window's predicted tokens, gives the gradient at the last layer's output;
then each layer is materialized again, last first, and run forward and backward one window at
a time from the gradient at its output, which leaves the gradient at its input for the layer
before. The gradients are the whole model's backward up to float rounding (tested against
transformers' model)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from llmq.calib.stream import LayerStream
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress

Watch = Callable[[nn.Module, str], AbstractContextManager[object]]
"""(a materialized layer, its prefix) -> the context its backward runs in (hooks go there)."""
AfterWindow = Callable[[nn.Module, str], None]
"""Reads a layer's weight gradients after each window's backward, before they are cleared."""


def backward_by_layer(
    ckpt: Checkpoint,
    input_ids: Tensor,
    watch: Watch,
    *,
    after_window: AfterWindow | None = None,
    device: str | None = None,
    progress: Progress = NO_PROGRESS,
) -> None:
    """Run the loss of `input_ids` [windows, seq] backward through every decoder layer, last
    first, entering `watch(layer, prefix)` around each layer's forward and backward (window by
    window: the loss is summed over the predicted tokens, so every token's gradient is its
    own). With `after_window`, the layer's weights get gradients too, read after each window."""
    # each expert on the tokens its router sends it: its inputs and output gradients are the
    # model's own (the default, every token through every expert, is for calibration)
    stream = LayerStream(ckpt, device=device, dtype=torch.float32, expert_tokens="routed")
    inputs = _layer_inputs(stream, input_ids, progress)
    gradient = _loss_gradient(stream, inputs.pop(), input_ids)
    with progress.stage("sensitivity: backward", total=stream.num_layers) as advance:
        for index in reversed(range(stream.num_layers)):
            layer = stream.load_layer(index)
            layer.requires_grad_(after_window is not None)
            prefix = stream.layout.layer_prefix(index)
            with watch(layer, prefix):
                gradient = _layer_backward(stream, layer, prefix, inputs.pop(), gradient, after_window)  # fmt: skip
            advance(1)


def _layer_inputs(stream: LayerStream, input_ids: Tensor, progress: Progress) -> list[Tensor]:
    """Each decoder layer's input, then the last one's output (kept in host memory)."""
    hidden = stream.embed(input_ids)
    inputs = [hidden.cpu()]
    walk = stream.walk(hidden, progress=progress, label="sensitivity: forward")
    for layer in walk:
        output = stream.run_layer(layer.module, layer.hidden)
        inputs.append(output.cpu())
        layer.advance(output)
    return inputs


def _loss_gradient(stream: LayerStream, hidden: Tensor, input_ids: Tensor) -> Tensor:
    """The gradient of each window's summed next-token loss at the last layer's output."""
    norm, head = stream.head()
    gradient = torch.empty_like(hidden)
    for row, window in enumerate(input_ids):
        top = hidden[row, :-1].to(stream.device, copy=True).requires_grad_()
        logits = stream.logits(norm, head, top)
        targets = window[1:].to(stream.device)
        loss = nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        (gradient_at_top,) = torch.autograd.grad(loss, top)
        gradient[row, :-1] = gradient_at_top.cpu()
        gradient[row, -1] = 0  # the last position predicts nothing
    return gradient


def _layer_backward(
    stream: LayerStream,
    layer: nn.Module,
    prefix: str,
    inputs: Tensor,
    gradient: Tensor,
    after_window: AfterWindow | None,
) -> Tensor:
    """The gradient at the layer's input, from the one at its output, window by window."""
    with torch.no_grad():
        position_embeddings = stream.position_embeddings(layer, inputs[:1].to(stream.device))
    at_input = torch.empty_like(inputs)
    for row in range(len(inputs)):
        hidden = inputs[row : row + 1].to(stream.device, copy=True).requires_grad_()
        output = layer(hidden, attention_mask=None, position_embeddings=position_embeddings)
        output = output[0] if isinstance(output, tuple) else output
        output.backward(gradient[row : row + 1].to(stream.device))
        at_input[row] = hidden.grad[0].cpu()  # type: ignore[index]
        if after_window is not None:
            after_window(layer, prefix)
            layer.zero_grad(set_to_none=True)
    return at_input
