"""`--moe-calibration all` against `routed` on a real mixture of experts whose router starves
one expert: model perplexity, and each expert's output error on held-out tokens routed to it.

The model: SmolLM2-135M upcycled into 4 experts, top-2, one expert routed about 1.5% of the
time (benchmarks/moe_from_dense.py explains the construction). GPTQ W4A16, groups of 64, the
same pydoc calibration windows for both modes; RTN as the floor. Perplexity: token perplexity,
first --windows 512-token windows of held-out news and Hamlet, no BOS, float32, against the
float mixture. Expert error: on the float mixture's own MLP inputs of every layer for the
first 4 of those news windows, the tokens the float router sends to each expert, ||Q(x) - F(x)|| / ||F(x)|| of
that expert's output, summed over layers (errors and norms each summed, then divided).

    python benchmarks/bench_moe_calibration.py [--samples 32] [--windows 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_from_dense import build, mlp_inputs

TEXTS = {"news": "news", "Hamlet": "shakespeare"}


def expert_errors(float_dir: Path, quantized: dict[str, Path], ids: torch.Tensor) -> dict:
    """Per mode, per expert: the relative output error on held-out tokens routed to it."""
    from transformers import AutoModelForCausalLM

    import llmq

    hf = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    inputs = mlp_inputs(hf, ids)
    reference = llmq.load_dequantized(float_dir)
    models = {mode: llmq.load_dequantized(out) for mode, out in quantized.items()}
    experts = hf.config.num_local_experts
    sums = {mode: torch.zeros(experts, 2, dtype=torch.float64) for mode in models}
    routed = torch.zeros(experts)
    with torch.no_grad():
        for index, x in enumerate(inputs):
            _, _, chosen = hf.model.layers[index].mlp.gate(x)
            for e in range(experts):
                rows = (chosen == e).any(-1)
                routed[e] += rows.sum()
                if not rows.any():
                    continue
                name = f"model.layers.{index}.block_sparse_moe.experts.{e}"
                want = reference.get_submodule(name)(x[rows])
                for mode, model in models.items():
                    got = model.get_submodule(name)(x[rows])
                    sums[mode][e] += torch.tensor([(got - want).norm() ** 2, want.norm() ** 2])
    return {
        "routed_share": (routed / routed.sum()).tolist(),
        **{mode: (s[:, 0] / s[:, 1]).sqrt().tolist() for mode, s in sums.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32, help="calibration windows of 512")
    parser.add_argument("--windows", type=int, default=10, help="held-out windows per text")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/moe-calibration"))
    args = parser.parse_args()
    import llmq
    from llmq.calib.data import evaluation_windows
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.models import builtin_model_path

    model = args.out / "float-moe"
    if not (model / "config.json").is_file():
        build(builtin_model_path("smollm2-135m"), model, 4, 2, [0.0, 0.0, -1.0, -3.0])
    calib = {"num_samples": args.samples, "seq_len": 512, "calib_text": "pydoc", "seed": 0}
    jobs = {
        "RTN": {"scheme": "w4a16", "group_size": 64},
        "GPTQ all": {"scheme": "w4a16", "group_size": 64, "method": "gptq", **calib},
        "GPTQ routed": {"scheme": "w4a16", "group_size": 64, "method": "gptq",
                        "moe_calibration": "routed", **calib},
    }  # fmt: skip
    rows = {}
    for label, options in jobs.items():
        out = args.out / label.replace(" ", "-")
        started = time.perf_counter()
        result = llmq.quantize(model, out, overwrite=True, **options)
        seconds = time.perf_counter() - started
        ppl = {
            name: llmq.evaluate(out, baseline=model, text=text, max_windows=args.windows)
            for name, text in TEXTS.items()
        }
        rows[label] = {
            "seconds": seconds, "out": str(out),
            "ppl": {n: [r.model.perplexity, r.baseline.perplexity, r.increase] for n, r in ppl.items()},
            "expert_tokens_layer0": result.layers[0].expert_tokens,
        }  # fmt: skip
        print(f"done: {label} {seconds:.0f} s", file=sys.stderr, flush=True)
    news = evaluation_windows(load_tokenizer(model), "news", seq_len=512, max_windows=4)
    errors = expert_errors(model, {k: Path(v["out"]) for k, v in rows.items()}, news.input_ids)
    report = {"date": time.strftime("%Y-%m-%d"), "rows": rows, "expert_errors": errors,
              "samples": args.samples, "windows": args.windows}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))


def markdown(report: dict) -> str:
    rows, errors = report["rows"], report["expert_errors"]
    base = next(iter(rows.values()))["ppl"]
    lines = [
        f"fp32 mixture: news {base['news'][1]:.3f}, Hamlet {base['Hamlet'][1]:.3f} "
        f"({report['windows']} x 512 tokens, no BOS); calibration {report['samples']} x 512 pydoc.",
        "",
        "| job | ppl news | ppl Hamlet | wall s |",
        "|---|---|---|---|",
    ]
    for label, row in rows.items():
        cells = " | ".join(f"{p[0]:.3f} ({p[2]:+.2%})" for p in row["ppl"].values())
        lines.append(f"| {label} | {cells} | {row['seconds']:.0f} |")
    lines += ["", "| expert | routed share (held-out) | " + " | ".join(f"{m} error" for m in rows) + " |",
              "|---|---|" + "---|" * len(rows)]  # fmt: skip
    for e, share in enumerate(errors["routed_share"]):
        lines.append(f"| {e} | {share:.1%} | " + " | ".join(f"{errors[m][e]:.4f}" for m in rows) + " |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
