"""Structured pruning on the default model, before any distillation: which ranking removes a
quarter of the decoder's parameters with the least damage (issue 34's first target).

    python benchmarks/bench_structured.py [--samples 128 --seq-len 512 --windows 12]

Two axes, each cutting the decoder layers' parameters by a quarter or a little more, each ranked
two ways on the same model (SmolLM2-135M-Instruct, float32):
- MLP width, 1536 -> 1024 channels in every layer (-25.0% of the decoder's parameters):
  llmq's activation importance (the L2 norm over calibration tokens of the activation entering
  down_proj) against the channel's weight norm (sqrt(|gate_j|^2 + |up_j|^2 + |down_:,j|^2));
- depth, 30 -> 22 layers (-26.7%): llmq's Block Importance (1 - cos of a layer's input and
  output, ShortGPT) against dropping the last 8 layers.
Activation scores come from one `llmq prune --structured` scoring pass on llmq's default mixed
calibration text (--samples x --seq-len tokens, seed 0), saved and reused by every row; the other
rankings are written as importance files of the same format. Perplexity protocol: token
perplexity, first --windows non-overlapping 512-token windows of the held-out splits of pydoc
and Hamlet, no BOS, float32.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import held_out_perplexity, ppl_cells, preamble, save_report


def weight_norm_scores(model: Path, layers: int) -> list[torch.Tensor]:
    """Per layer, each MLP channel's weights (its gate and up rows, its down column) as one
    L2 norm: the naive ranking."""
    from llmq.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model)
    scores = []
    for index in range(layers):
        prefix = ckpt.layout.layer_prefix(index)
        gate, up, down = (ckpt.read(f"{prefix}mlp.{n}_proj.weight").double() for n in ("gate", "up", "down"))  # fmt: skip
        scores.append((gate.square().sum(1) + up.square().sum(1) + down.square().sum(0)).sqrt())
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=12, help="512-token windows per text")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/structured"))
    args = parser.parse_args()

    import llmq
    from llmq.models import builtin_model_path
    from llmq.pruning.structured import Importance

    model = builtin_model_path("smollm2-135m")
    args.out.mkdir(parents=True, exist_ok=True)
    scores = args.out / "activation.safetensors"
    calib = {"num_samples": args.samples, "seq_len": args.seq_len, "evaluate": False, "overwrite": True}  # fmt: skip
    started = time.perf_counter()
    llmq.prune_structured(model, args.out / "scoring", intermediate_size=1536, num_layers=29,
                          save_importance=scores, **calib)  # fmt: skip
    scoring_s = time.perf_counter() - started
    activation = Importance.load(scores)
    layers = len(activation.blocks)
    naive = {
        "weight-norm.safetensors": Importance(
            weight_norm_scores(model, layers),
            activation.kv_groups,
            activation.blocks,
            activation.hidden,
        ),
        "last-layers.safetensors": Importance(
            activation.channels,
            activation.kv_groups,
            -torch.arange(layers, dtype=torch.float64),
            activation.hidden,
        ),
    }
    for name, importance in naive.items():
        importance.save(args.out / name)
    jobs = [
        (
            "MLP 1536 -> 1024, activation importance (llmq)",
            "activation",
            {"intermediate_size": 1024},
        ),
        ("MLP 1536 -> 1024, weight norm", "weight-norm", {"intermediate_size": 1024}),
        ("depth 30 -> 22, Block Importance (llmq)", "activation", {"num_layers": 22}),
        ("depth 30 -> 22, last 8 layers dropped", "last-layers", {"num_layers": 22}),
    ]
    rows = []
    for label, ranking, targets in jobs:
        folder = args.out / label.split(",")[0].replace(" ", "").replace(">", "") / ranking
        began = time.perf_counter()
        result = llmq.prune_structured(model, folder, importance=args.out / f"{ranking}.safetensors", **targets, **calib)  # fmt: skip
        rows.append({"label": label, "wall_s": time.perf_counter() - began,
                     "parameters": result.parameters, "removed": result.removed,
                     "ppl": held_out_perplexity(folder, model, args.windows)})  # fmt: skip
        print(f"done: {label}", flush=True)
    calibration = f"shakespeare+pydoc (llmq's default), {args.samples} x {args.seq_len} tokens, seed 0; scoring pass {scoring_s:.0f} s"  # fmt: skip
    save_report(args.out, rows, args.windows, markdown, calibration=calibration)


def markdown(report: dict) -> str:
    lines = [
        preamble(report),
        "",
        "| cut | parameters | ppl held-out pydoc | ppl Hamlet |",
        "|---|---|---|---|",
    ]
    for row in report["rows"]:
        params = row["parameters"]
        share = params["output"] / params["source"] - 1
        lines.append(f"| {row['label']} | {params['output'] / 1e6:.1f} M ({share:+.1%}) | {ppl_cells(row)} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
