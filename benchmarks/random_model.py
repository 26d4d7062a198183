"""Write a randomly initialised Hugging Face Llama checkpoint of a given architecture: what the
GPU benchmarks quantize and time end to end where the real model cannot travel (speed depends on
the shapes, not on the weight values).

    python benchmarks/random_model.py OUT [--arch smollm2-135m|llama3-8b] [--layers N]
        [--tokenizer DIR] [--max-shard-size 2GB] [--device cuda]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ARCHS = {
    # the default model's architecture (see ../shared/embedded-default.md)
    "smollm2-135m": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
    "llama3-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rope_theta": 500000.0, "tie_word_embeddings": False,
    },
    "llama3-70b": {
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "rope_theta": 500000.0, "tie_word_embeddings": False,
    },
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="smollm2-135m")
    parser.add_argument("--layers", type=int, help="fewer decoder layers than the real model")
    parser.add_argument(
        "--tokenizer", type=Path, help="copy this folder's tokenizer files (calibration needs one)"
    )
    parser.add_argument("--max-shard-size", help="e.g. 2GB: several shards, as the hub's are")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where to draw the weights (cuda: seconds for 8B, not minutes)",
    )
    args = parser.parse_args()
    fields = {**ARCHS[args.arch], "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**fields))
    model.save_pretrained(args.out, **({"max_shard_size": args.max_shard_size} if args.max_shard_size else {}))  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if args.tokenizer and (args.tokenizer / name).is_file():
            shutil.copy(args.tokenizer / name, Path(args.out) / name)
    print(f"wrote {args.out}: {args.arch}, {model.config.num_hidden_layers} layers")


if __name__ == "__main__":
    main()
