#!/usr/bin/env python3
"""Prune a Hugging Face checkpoint with llm-compressor's one-shot SparseGPT or Wanda (peer runner).

Runs INSIDE benchmarks/.venvs/llmcompressor (see setup_llmcompressor.sh); it is
never imported by llmq. Loads the model in float32 on CPU, runs llm-compressor's
``oneshot`` with ``SparseGPTModifier`` or ``WandaPruningModifier`` (their default
dampening and block size) on the decoder layers' linears only, saves a dense
checkpoint plus the tokenizer to ``--out`` and prints ONE JSON line with timings
on stdout. Everything else (llm-compressor's logs, progress bars, warnings, the
zero counts of the saved checkpoint) goes to stderr.

Targets: the decoder-layer classes (``model._no_split_modules``, e.g.
LlamaDecoderLayer), not ``"Linear"``. With ``targets="Linear"`` every Linear is
its own target "layer" and is named ``"<name>."`` (a trailing dot) when matched
against ``ignore``, so ``ignore=["lm_head"]`` never matches and the lm_head
(tied to the embedding) is pruned without a warning. After saving, the runner
counts zeros in the checkpoint and exits non-zero if the embedding / lm_head has
more zeros than in the input checkpoint.

N:M: ``--pattern N:M`` keeps N of every M weights (llmq's meaning). llm-compressor's
``mask_structure="N:M"`` PRUNES N of every M, so the runner passes ``f"{M-N}:{M}"``
(identical for 2:4) and ``sparsity=1 - N/M``.

Example:
    benchmarks/.venvs/llmcompressor/bin/python benchmarks/peers/llmcompressor_prune.py \
        --model /tmp/peer-model --out /tmp/out-sgpt --method sparsegpt --pattern 2:4 \
        --calib /tmp/calib.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from llmcompressor_quantize import load_calibration, run_with_clean_stdout

METHODS = ("sparsegpt", "wanda")
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
PROBE = "model.layers.0.self_attn.q_proj.weight"


def parse_pattern(text: str) -> tuple[int, int]:
    try:
        n, m = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N:M, e.g. 2:4") from None
    if not 0 < n < m:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 0 < N < M")
    return n, m


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF float32 checkpoint folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--method", required=True, choices=METHODS)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--sparsity", type=float, help="unstructured: share of each row removed")
    target.add_argument(
        "--pattern", type=parse_pattern, help="N:M: keep N of every M consecutive inputs"
    )
    p.add_argument(
        "--calib",
        required=True,
        help="safetensors file with one int64 tensor `input_ids` [num_samples, seq_len]",
    )
    args = p.parse_args(argv)
    if args.sparsity is not None and not 0 < args.sparsity < 1:
        p.error(f"--sparsity {args.sparsity}: must be in (0, 1)")
    return args


def log(msg: str) -> None:
    print(f"[llmcompressor_prune] {msg}", file=sys.stderr, flush=True)


def modifier_kwargs(args, model) -> dict:
    """sparsity / mask_structure / targets for SparseGPTModifier and WandaPruningModifier."""
    from llmcompressor.utils.pytorch.module import get_no_split_params

    # The decoder-layer classes, e.g. {"LlamaDecoderLayer"} (a set in transformers 5); a str
    # ("__ALL__") when the model names none.
    layers = get_no_split_params(model)
    layers = [] if isinstance(layers, str) else sorted(layers)
    if not layers:
        raise SystemExit(f"{args.model}: no decoder-layer class (_no_split_modules) to target")
    if args.pattern is not None:
        keep, m = args.pattern
        sparsity, mask_structure = 1 - keep / m, f"{m - keep}:{m}"  # the peer's N is pruned
    else:
        sparsity, mask_structure = args.sparsity, "0:0"  # 0:0 = unstructured
    return {"sparsity": sparsity, "mask_structure": mask_structure, "targets": layers}


def build_recipe(args, model):
    from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier

    kwargs = modifier_kwargs(args, model)
    modifier = SparseGPTModifier if args.method == "sparsegpt" else WandaPruningModifier
    return [modifier(**kwargs)], kwargs


def zero_counts(folder: str, *, linears: bool = True) -> dict:
    """Zeros in a checkpoint's safetensors: the embedding, the lm_head (when stored untied),
    one q_proj and (with `linears`) all decoder-layer linears together."""
    from pathlib import Path

    from safetensors import safe_open

    counts: dict[str, list[int]] = {}
    total = [0, 0]
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                named = name in (EMBEDDING, LM_HEAD, PROBE)
                linear = (
                    linears and name.startswith("model.layers.") and name.endswith("proj.weight")
                )
                if not (named or linear):
                    continue
                t = f.get_tensor(name)
                zeros, size = int((t == 0).sum()), t.numel()
                if named:
                    counts[name] = [zeros, size]
                if linear:
                    total[0] += zeros
                    total[1] += size
    if linears:
        counts["decoder linears (all)"] = total
    return {
        k: {"zeros": z, "total": n, "fraction": round(z / n, 6)} for k, (z, n) in counts.items()
    }


def check_dense_ends(zeros: dict, before: dict, tied: bool) -> None:
    """Log the zero counts of the output (and of the input, for the embedding and lm_head,
    which hold a few exact zeros already); fail when either gained a zero."""
    for name, c in zeros.items():
        was = f"; input {before[name]['zeros']}" if name in (EMBEDDING, LM_HEAD) else ""
        log(f"zeros {name}: {c['zeros']} / {c['total']} ({c['fraction']:.2%}{was})")
    if LM_HEAD not in zeros:
        log(f"{LM_HEAD} not stored: tied to {EMBEDDING}" if tied else f"{LM_HEAD} not stored")
    for name in (EMBEDDING, LM_HEAD):
        if name in zeros and zeros[name]["zeros"] > before.get(name, {"zeros": 0})["zeros"]:
            raise SystemExit(f"{name} was pruned: {zeros[name]['zeros']} zeros, input had fewer")


def main(argv=None) -> int:
    return run_with_clean_stdout(run, parse_args(argv))


def run(args) -> dict:
    t_start = time.perf_counter()
    from importlib.metadata import version

    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import_s = time.perf_counter() - t_start
    torch.manual_seed(0)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, device_map=None)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load_s = time.perf_counter() - t0
    tied = bool(model.config.get_text_config().tie_word_embeddings)

    recipe, kwargs = build_recipe(args, model)
    log(f"recipe: {recipe}")

    dataset, num_samples, seq_len = load_calibration(args.calib)
    log(f"calibration: {num_samples} samples x {seq_len} tokens from {args.calib}")

    t0 = time.perf_counter()
    model = oneshot(
        model=model,
        tokenizer=tokenizer,
        recipe=recipe,
        dataset=dataset,
        num_calibration_samples=num_samples,
        max_seq_length=seq_len,
        shuffle_calibration_samples=False,
        batch_size=1,
    )
    oneshot_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    # Dense: compressed-tensors no longer writes sparse formats; say so explicitly.
    model.save_pretrained(args.out, save_compressed=False)
    tokenizer.save_pretrained(args.out)
    save_s = time.perf_counter() - t0
    total_s = time.perf_counter() - t_start

    # Outside the timings (a check, not the peer's work): the embedding / lm_head unpruned?
    zeros = zero_counts(args.out)
    check_dense_ends(zeros, zero_counts(args.model, linears=False), tied)

    return {
        "tool": "llm-compressor",
        "version": version("llmcompressor"),
        "compressed_tensors_version": version("compressed-tensors"),
        "transformers_version": version("transformers"),
        "torch_version": torch.__version__,
        "method": args.method,
        "sparsity": kwargs["sparsity"],
        "mask_structure": kwargs["mask_structure"],
        "targets": kwargs["targets"],
        "num_samples": num_samples,
        "seq_len": seq_len,
        "threads": torch.get_num_threads(),
        "zeros": zeros,
        "import_s": round(import_s, 3),
        "load_s": round(load_s, 3),
        "oneshot_s": round(oneshot_s, 3),
        "save_s": round(save_s, 3),
        "total_s": round(total_s, 3),  # the zero counts (a check) excluded
    }


if __name__ == "__main__":
    sys.exit(main())
