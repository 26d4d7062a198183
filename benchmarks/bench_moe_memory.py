"""GPTQ of a mixture-of-experts layer at real shapes on the CPU: peak memory and time per layer
(random bf16 weights: shapes decide time and memory, values do not). `--family qwen3_moe`:
Qwen3-235B-A22B's layers, W4A16; `--family gpt_oss`: GPT-OSS-20B's (its experts stored fused,
biased), written in its own MXFP4 release format (mxfp4a16).

The checkpoint is written tensor by tensor with safetensors (transformers would first build the
whole model in float32); SmolLM2's tokenizer gives the calibration ids (all below either
vocabulary). Every token runs through every expert during calibration (`--moe-calibration
all`, the default), so the calibration passes cost (experts / experts per token) times a routed
forward pass of the MLP.

    python benchmarks/bench_moe_memory.py [--family qwen3_moe] [--layers 2] [--samples 4]
        [--seq-len 128] [--experts N] [--method gptq]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, run_measured, write_json

SHAPES = {  # Qwen3-235B-A22B's config.json, but for the number of layers
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "intermediate_size": 12288,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "norm_topk_prob": True, "tie_word_embeddings": False,
    "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16",
}  # fmt: skip


GPT_OSS_SHAPES = {  # GPT-OSS-20B's config.json (bfloat16 experts), but for the number of layers
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
    "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088, "rms_norm_eps": 1e-5,
    "sliding_window": 128, "rope_theta": 150000, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def random_tensor(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)


def attention_tensors(
    index: int, shapes: dict, generator: torch.Generator, *, bias: bool
) -> dict[str, torch.Tensor]:
    """A layer's two norms and q/k/v/o projections (with biases where the family has them)."""
    h, heads, kv, d = (shapes[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))  # fmt: skip
    p = f"model.layers.{index}."
    tensors = {
        f"{p}input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for name, rows, columns in (("q", heads * d, h), ("k", kv * d, h), ("v", kv * d, h), ("o", h, heads * d)):  # fmt: skip
        tensors[f"{p}self_attn.{name}_proj.weight"] = random_tensor(rows, columns, generator=generator)  # fmt: skip
        if bias:
            tensors[f"{p}self_attn.{name}_proj.bias"] = random_tensor(rows, generator=generator)
    return tensors


def gpt_oss_layer_tensors(index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Sinks, a biased router, and the experts fused as GPT-OSS stores them."""
    shapes = GPT_OSS_SHAPES
    h, heads = shapes["hidden_size"], shapes["num_attention_heads"]
    experts, inter = shapes["num_local_experts"], shapes["intermediate_size"]
    p = f"model.layers.{index}."
    return {
        **attention_tensors(index, shapes, generator, bias=True),
        f"{p}self_attn.sinks": random_tensor(heads, generator=generator),
        f"{p}mlp.router.weight": random_tensor(experts, h, generator=generator) * 25,
        f"{p}mlp.router.bias": random_tensor(experts, generator=generator),
        f"{p}mlp.experts.gate_up_proj": random_tensor(experts, h, 2 * inter, generator=generator),
        f"{p}mlp.experts.gate_up_proj_bias": random_tensor(experts, 2 * inter, generator=generator),
        f"{p}mlp.experts.down_proj": random_tensor(experts, inter, h, generator=generator),
        f"{p}mlp.experts.down_proj_bias": random_tensor(experts, h, generator=generator),
    }


def layer_tensors(index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """q/k norms, a router, and every expert's linears under its own name (Qwen3-MoE)."""
    h, d = SHAPES["hidden_size"], SHAPES["head_dim"]
    experts, inter = SHAPES["num_experts"], SHAPES["moe_intermediate_size"]
    p = f"model.layers.{index}."
    tensors = {
        **attention_tensors(index, SHAPES, generator, bias=False),
        f"{p}self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        f"{p}self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        f"{p}mlp.gate.weight": random_tensor(experts, h, generator=generator) * 25,
    }
    for e in range(experts):
        q = f"{p}mlp.experts.{e}."
        tensors[f"{q}gate_proj.weight"] = random_tensor(inter, h, generator=generator)
        tensors[f"{q}up_proj.weight"] = random_tensor(inter, h, generator=generator)
        tensors[f"{q}down_proj.weight"] = random_tensor(h, inter, generator=generator)
    return tensors


# per family: its config, one layer's tensors, the config key of its expert count, its scheme
FAMILIES = {
    "qwen3_moe": (SHAPES, layer_tensors, "num_experts", "w4a16"),
    "gpt_oss": (GPT_OSS_SHAPES, gpt_oss_layer_tensors, "num_local_experts", "mxfp4a16"),
}


def write_model(folder: Path, layers: int, tokenizer_from: Path, family: str) -> None:
    shapes, tensors_of = FAMILIES[family][:2]
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    h, vocab = shapes["hidden_size"], shapes["vocab_size"]
    shards = {"model-embed.safetensors": {
        "model.embed_tokens.weight": random_tensor(vocab, h, generator=generator),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": random_tensor(vocab, h, generator=generator),
    }}  # fmt: skip
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    for i in range(layers):
        name = f"model-layer{i}.safetensors"
        tensors = tensors_of(i, generator)
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({**shapes, "num_hidden_layers": layers}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe")
    parser.add_argument("--method", default="gptq", help="gptq (default) or rtn")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--experts", type=int, help="fewer than the family's, for a quick check")
    parser.add_argument(
        "--tokenizer", type=Path, help="a folder with tokenizer.json (default: SmolLM2's)"
    )
    parser.add_argument("--device", default="cpu", help="where llmq runs the layers")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-moe-memory"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/moe-memory.json"))
    args = parser.parse_args()
    shapes, tensors_of, count_key, scheme = FAMILIES[args.family]
    if args.experts:
        shapes[count_key] = args.experts
        shapes["num_experts_per_tok"] = min(shapes["num_experts_per_tok"], args.experts)
    shutil.rmtree(args.work, ignore_errors=True)
    model = args.work / "model"
    if args.tokenizer is None:
        from llmq.models import resolve_model

        args.tokenizer = resolve_model("smollm2-135m")
    write_model(model, args.layers, Path(args.tokenizer), args.family)
    layer_bytes = sum(t.numel() * 2 for t in tensors_of(0, torch.Generator()).values())
    out = args.work / "out"
    cmd = [sys.executable, "-m", "llmq.cli.main", "quantize", str(model), "--out", str(out), "--scheme", scheme, "--method",
           args.method, "--no-reference", "--no-space-check", "--device", args.device, "--json"]  # fmt: skip
    if args.method != "rtn":
        cmd += ["--num-samples", str(args.samples), "--seq-len", str(args.seq_len)]
    measured = run_measured(cmd)
    result = json.loads(measured.stdout)
    report = {
        "machine": machine(),
        "device": args.device,
        "command": " ".join(cmd),
        "family": args.family,
        "layers": args.layers,
        "experts": shapes[count_key],
        "calibration_tokens": 0 if args.method == "rtn" else args.samples * args.seq_len,
        "layer_bf16_gb": round(layer_bytes / 1e9, 2),
        "layer_float32_gb": round(2 * layer_bytes / 1e9, 2),
        "wall_s": round(measured.wall_s, 1),
        "peak_rss_gb": round(measured.peak_rss_bytes / 1e9, 2),
        "layer_seconds": [round(layer["seconds"], 1) for layer in result["layers"]],
        "expert_tokens_min_max": [
            [min(layer["expert_tokens"]), max(layer["expert_tokens"])]
            for layer in result["layers"]
            if layer.get("expert_tokens")
        ],
        "output_gb": round(result["size_bytes"]["output"] / 1e9, 2),
    }
    write_json(args.out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
