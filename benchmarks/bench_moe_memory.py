"""GPTQ W4A16 of a mixture-of-experts layer at Qwen3-235B-A22B's shapes on the CPU: peak memory
and time per layer (random bf16 weights: shapes decide time and memory, values do not).

The checkpoint is written tensor by tensor with safetensors (transformers would first build the
whole model in float32); SmolLM2's tokenizer gives the calibration ids (all below the 151,936
vocabulary). Every token runs through all 128 experts during calibration (`--moe-calibration
all`, the default), so the calibration passes cost 16x a routed forward pass of the MLP.

    python benchmarks/bench_moe_memory.py [--layers 2] [--samples 4] [--seq-len 128] [--experts 128]
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


def random_tensor(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)


def layer_tensors(index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    h, heads, kv, d = (SHAPES[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))  # fmt: skip
    experts, inter = SHAPES["num_experts"], SHAPES["moe_intermediate_size"]
    p = f"model.layers.{index}."
    tensors = {
        f"{p}input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}self_attn.q_proj.weight": random_tensor(heads * d, h, generator=generator),
        f"{p}self_attn.k_proj.weight": random_tensor(kv * d, h, generator=generator),
        f"{p}self_attn.v_proj.weight": random_tensor(kv * d, h, generator=generator),
        f"{p}self_attn.o_proj.weight": random_tensor(h, heads * d, generator=generator),
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


def write_model(folder: Path, layers: int, tokenizer_from: Path) -> None:
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    h, vocab = SHAPES["hidden_size"], SHAPES["vocab_size"]
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
        tensors = layer_tensors(i, generator)
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({**SHAPES, "num_hidden_layers": layers}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--experts", type=int, default=128, help="fewer, for a quick check")
    parser.add_argument(
        "--tokenizer", type=Path, help="a folder with tokenizer.json (default: SmolLM2's)"
    )
    parser.add_argument("--device", default="cpu", help="where llmq runs the layers")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-moe-memory"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/moe-memory.json"))
    args = parser.parse_args()
    SHAPES["num_experts"] = args.experts
    shutil.rmtree(args.work, ignore_errors=True)
    model = args.work / "model"
    if args.tokenizer is None:
        from llmq.models import resolve_model

        args.tokenizer = resolve_model("smollm2-135m")
    write_model(model, args.layers, Path(args.tokenizer))
    layer_bytes = sum(t.numel() * 2 for t in layer_tensors(0, torch.Generator()).values())
    out = args.work / "out"
    cmd = [sys.executable, "-m", "llmq.cli.main", "quantize", str(model), "--out", str(out), "--scheme", "w4a16", "--method",
           "gptq", "--num-samples", str(args.samples), "--seq-len", str(args.seq_len),
           "--no-reference", "--no-space-check", "--device", args.device, "--json"]  # fmt: skip
    measured = run_measured(cmd)
    result = json.loads(measured.stdout)
    report = {
        "machine": machine(),
        "device": args.device,
        "command": " ".join(cmd),
        "layers": args.layers,
        "experts": args.experts,
        "calibration_tokens": args.samples * args.seq_len,
        "layer_bf16_gb": round(layer_bytes / 1e9, 2),
        "layer_float32_gb": round(2 * layer_bytes / 1e9, 2),
        "wall_s": round(measured.wall_s, 1),
        "peak_rss_gb": round(measured.peak_rss_bytes / 1e9, 2),
        "layer_seconds": [round(layer["seconds"], 1) for layer in result["layers"]],
        "expert_tokens_min_max": [
            [min(layer["expert_tokens"]), max(layer["expert_tokens"])] for layer in result["layers"]
        ],
        "output_gb": round(result["size_bytes"]["output"] / 1e9, 2),
    }
    write_json(args.out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
