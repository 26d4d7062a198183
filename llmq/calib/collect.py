"""`llmq calibrate`: per-linear input statistics of the float model, one layer at a time."""

from __future__ import annotations

from torch import Tensor

from llmq.calib.stats import CalibStats, InputStats
from llmq.calib.stream import LayerStream, input_hooks
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress


def collect_stats(
    ckpt: Checkpoint,
    input_ids: Tensor,
    *,
    hessian: bool = False,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> CalibStats:
    """Statistics of every linear input of every layer, on the float model's activations.

    Linears sharing an input (the family table's groups) share one InputStats."""
    stream = LayerStream(ckpt, device=device)
    hidden = stream.embed(input_ids)
    stats = CalibStats()
    with progress.stage("calibrating layers", total=ckpt.num_layers) as advance:
        for index in range(ckpt.num_layers):
            prefix = stream.layout.layer_prefix(index)
            layer = stream.load_layer(index)
            owners = {name: group[0] for group in stream.layout.sequential for name in group}
            layer_stats: dict[str, InputStats] = {}

            def observe(
                name: str,
                x: Tensor,
                owners: dict[str, str] = owners,
                layer_stats: dict[str, InputStats] = layer_stats,
            ) -> None:
                if owners[name] != name:
                    return
                if name not in layer_stats:
                    layer_stats[name] = InputStats.empty(
                        x.shape[-1], hessian=hessian, device=x.device
                    )
                layer_stats[name].update(x)

            batches = len(list(stream.batches(hidden)))
            with (
                progress.stage(f"layer {index}", total=batches, transient=True) as step,
                input_hooks(layer, list(owners), observe),
            ):
                hidden = stream.run_layer(layer, hidden, on_batch=lambda: step(1))
            for name, owner in owners.items():
                stats.inputs[prefix + name] = layer_stats[owner]
            advance(1)
    return stats
