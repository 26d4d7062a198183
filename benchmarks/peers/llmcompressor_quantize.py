#!/usr/bin/env python3
"""Quantize a Hugging Face checkpoint with llm-compressor (peer runner).

Runs INSIDE benchmarks/.venvs/llmcompressor (see setup_llmcompressor.sh); it is
never imported by llmq. Loads the model on the CPU (float32 unless --dtype auto; on a GPU
machine llm-compressor onloads one layer at a time to the GPU), runs llm-compressor's
``oneshot`` with the modifier matching ``--method``, saves the compressed
checkpoint (compressed-tensors format) plus the tokenizer to ``--out`` and
prints ONE JSON line with timings on stdout. Everything else (llm-compressor's
logs, progress bars, warnings) goes to stderr.

Example:
    benchmarks/.venvs/llmcompressor/bin/python benchmarks/peers/llmcompressor_quantize.py \
        --model /tmp/peer-model --out /tmp/out-w4 --scheme W4A16 --method gptq \
        --group-size 64 --calib /tmp/calib.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# compressed-tensors 0.19 presets. The FP4/MX ones have the formats' own group sizes: NVFP4A16 and
# NVFP4 E2M1 codes in groups of 16 (E4M3 scales under a per-tensor global scale, strategy
# tensor_group), MXFP4A16/MXFP4 E2M1 and MXFP8A16/MXFP8 E4M3 codes in groups of 32 (E8M0 scales).
SCHEMES = (
    "W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC",
    "NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8",
)  # fmt: skip
METHODS = ("rtn", "gptq", "awq", "smoothquant-gptq")
NEEDS_CALIB = ("gptq", "awq", "smoothquant-gptq")
# Presets that need calibration data whatever the method: NVFP4's input activations are
# dynamic="local" (group scales at run time under a per-tensor global scale that is calibrated),
# so even QuantizationModifier (rtn) runs the sequential pipeline and has no data without --calib.
# MXFP4/MXFP8 activations are plainly dynamic (no calibrated parameter).
SCHEMES_NEEDING_CALIB = ("NVFP4",)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="override the preset's weight group size for group-wise presets "
        "(W4A16, W4A16_ASYM and, in compressed-tensors 0.19, W8A16: all default to "
        "128, which does not divide hidden size 576); 0 = per-output-channel "
        "weights instead of groups. Ignored with a warning for presets that are "
        "already per-channel (W8A8, FP8_DYNAMIC) and for the FP4/MX presets, whose "
        "format fixes the group size (NVFP4*: 16, MX*: 32)",
    )
    p.add_argument(
        "--calib",
        default=None,
        help="safetensors file with one int64 tensor `input_ids` [num_samples, seq_len] "
        "(required for gptq/awq/smoothquant-gptq and for --scheme NVFP4 with any method: "
        "its activation global scale is calibrated; optional otherwise)",
    )
    p.add_argument(
        "--ignore",
        action="append",
        default=None,
        help="module name/pattern to leave unquantized (repeatable; default: lm_head)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "auto"),
        default="float32",
        help="load dtype: float32 (the CPU benchmarks) or auto (the checkpoint's own, as "
        "llm-compressor's GPU examples load it: on the CPU, onloaded a layer at a time)",
    )
    p.add_argument(
        "--smoothing-strength",
        type=float,
        default=0.8,
        help="SmoothQuant alpha for smoothquant-gptq (default 0.8)",
    )
    args = p.parse_args(argv)
    if args.ignore is None:
        args.ignore = ["lm_head"]
    if args.method in NEEDS_CALIB and not args.calib:
        p.error(f"--calib is required for --method {args.method}")
    if args.scheme in SCHEMES_NEEDING_CALIB and not args.calib:
        p.error(
            f"--calib is required for --scheme {args.scheme} (its input activations' "
            "global scale is calibrated), also with --method rtn"
        )
    if args.group_size is not None and args.group_size < 0:
        p.error("--group-size must be >= 0 (0 = per-channel)")
    return args


def log(msg: str) -> None:
    print(f"[llmcompressor_quantize] {msg}", file=sys.stderr, flush=True)


def build_quant_kwargs(scheme: str, group_size: int | None, ignore: list[str]):
    """kwargs for QuantizationModifier / GPTQModifier and the effective group size."""
    from compressed_tensors.quantization import (
        QuantizationStrategy,
        QuantizationType,
        preset_name_to_scheme,
    )

    preset = preset_name_to_scheme(scheme, ["Linear"])
    is_group = preset.weights is not None and preset.weights.strategy in (
        QuantizationStrategy.GROUP,
        QuantizationStrategy.TENSOR_GROUP,
    )
    # NVFP4 (tensor_group of 16, E4M3 scales) and MX (group of 32, E8M0 scales): float codes in
    # groups whose size is the format's own; kernels and loaders assume it.
    fixed_group = is_group and preset.weights.type == QuantizationType.FLOAT
    if group_size is not None and fixed_group:
        log(
            f"WARNING: --group-size {group_size} ignored: {scheme} fixes its group size "
            f"({preset.weights.group_size})"
        )
        group_size = None
    if group_size is not None and not is_group:
        log(
            f"WARNING: --group-size {group_size} ignored: {scheme} quantizes weights "
            f"per {preset.weights.strategy.value}, not per group"
        )
        group_size = None
    if group_size is None:
        effective = preset.weights.group_size if is_group else None
        return {"targets": "Linear", "scheme": scheme, "ignore": list(ignore)}, effective
    if group_size == 0:  # per-output-channel scales instead of groups
        preset.weights.strategy = QuantizationStrategy.CHANNEL
        preset.weights.group_size = None
        return {"config_groups": {"group_0": preset}, "ignore": list(ignore)}, None
    preset.weights.group_size = group_size
    return (
        {"config_groups": {"group_0": preset}, "ignore": list(ignore)},
        group_size,
    )


def patch_cpu_only() -> None:
    """Work around llm-compressor 0.14.0.1 on machines without an accelerator.

    AWQModifier._apply_smoothing pins the cached activations
    (IntermediatesCache.pin_memory) "for faster onloading"; on a CPU-only
    torch build Tensor.pin_memory() raises "Cannot access accelerator device
    when none is available". Pinning only speeds up host->device copies, so
    without an accelerator it is skipped. Numerics are unchanged.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        return

    def _no_pin(self, batch_index, input_names=None):
        return None

    IntermediatesCache.pin_memory = _no_pin


def build_recipe(args):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    qkw, effective_gs = build_quant_kwargs(args.scheme, args.group_size, args.ignore)
    if args.method == "rtn":
        recipe = [QuantizationModifier(**qkw)]
    elif args.method == "gptq":
        recipe = [GPTQModifier(**qkw)]
    elif args.method == "awq":
        # llm-compressor 0.14: AWQ is a transform; quantization is done by a
        # following QuantizationModifier (the old AWQModifier(scheme=...) is a
        # deprecated shim that expands to exactly this pair).
        from llmcompressor.modifiers.transform import AWQModifier

        recipe = [AWQModifier(), QuantizationModifier(**qkw)]
    elif args.method == "smoothquant-gptq":
        from llmcompressor.modifiers.transform import SmoothQuantModifier

        recipe = [
            SmoothQuantModifier(smoothing_strength=args.smoothing_strength),
            GPTQModifier(**qkw),
        ]
    else:  # argparse already restricts this
        raise ValueError(args.method)
    return recipe, effective_gs


def load_calibration(path: str):
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file

    tensors = load_file(path)
    if "input_ids" not in tensors:
        raise SystemExit(f"{path}: no tensor named 'input_ids' (have {list(tensors)})")
    ids = tensors["input_ids"]
    if ids.ndim != 2:
        raise SystemExit(
            f"{path}: input_ids must be 2-D [num_samples, seq_len], got {tuple(ids.shape)}"
        )
    ids = ids.to(torch.int64)
    num_samples, seq_len = ids.shape
    ds = Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "attention_mask": torch.ones_like(ids).tolist(),
        }
    )
    return ds, int(num_samples), int(seq_len)


def main(argv=None) -> int:
    return run_with_clean_stdout(run, parse_args(argv))


def run_with_clean_stdout(run, args) -> int:
    """Run `run(args)` offline with everything it prints sent to stderr, then print its
    result as the one JSON line on stdout (the contract of every peer runner)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    # Keep stdout clean for the single JSON result line: point fd 1 at stderr
    # while the libraries run (they print/log/progress-bar freely), restore after.
    sys.stdout.flush()
    saved_stdout_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        result = run(args)
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout_fd, 1)
        os.close(saved_stdout_fd)
    print(json.dumps(result), flush=True)
    return 0


def run(args) -> dict:
    t_start = time.perf_counter()
    from importlib.metadata import version

    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import_s = time.perf_counter() - t_start
    patch_cpu_only()
    torch.manual_seed(0)

    t0 = time.perf_counter()
    dtype = torch.float32 if args.dtype == "float32" else "auto"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map=None)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load_s = time.perf_counter() - t0

    recipe, effective_gs = build_recipe(args)
    log(f"recipe: {recipe}")

    oneshot_kwargs = {}
    num_samples = seq_len = None
    if args.calib:
        dataset, num_samples, seq_len = load_calibration(args.calib)
        oneshot_kwargs.update(
            dataset=dataset,
            num_calibration_samples=num_samples,
            max_seq_length=seq_len,
            shuffle_calibration_samples=False,
            batch_size=1,
        )
        log(f"calibration: {num_samples} samples x {seq_len} tokens from {args.calib}")

    t0 = time.perf_counter()
    model = oneshot(model=model, tokenizer=tokenizer, recipe=recipe, **oneshot_kwargs)
    oneshot_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    save_s = time.perf_counter() - t0

    return {
        "tool": "llm-compressor",
        "version": version("llmcompressor"),
        "compressed_tensors_version": version("compressed-tensors"),
        "transformers_version": version("transformers"),
        "torch_version": torch.__version__,
        "scheme": args.scheme,
        "method": args.method,
        "group_size": effective_gs,
        "num_samples": num_samples,
        "seq_len": seq_len,
        "ignore": args.ignore,
        "threads": torch.get_num_threads(),
        "import_s": round(import_s, 3),
        "load_s": round(load_s, 3),
        "oneshot_s": round(oneshot_s, 3),
        "save_s": round(save_s, 3),
        "total_s": round(time.perf_counter() - t_start, 3),
    }


if __name__ == "__main__":
    sys.exit(main())
