"""A real mixture of experts to measure calibration on: SmolLM2-135M upcycled into Mixtral form.

Sparse upcycling (Komatsuzaki et al., 2022): every expert of a layer starts as a copy of the
dense MLP; here each copy's weights are multiplied by (1 + 0.02 · N(0, 1)), independently per
expert, so the experts differ and each needs its own quantization, while any mix of them stays
close to the dense MLP (the float mixture is a working language model; its perplexity is
measured, not assumed). The router scores expert e as s · r_e · x + b_e · (m · x) / |m|², with
r_e a random direction, s setting that part's spread to 1, and m the mean MLP input of the layer
on a few pydoc windows: b_e acts as a per-expert bias, so the router prefers some experts and
starves others, as trained routers do. Attention, norms and embeddings are SmolLM2's own.

    python benchmarks/moe_from_dense.py OUT [--experts 4] [--top-k 2] [--bias 0,0,-1,-3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

NOISE = 0.02  # relative spread of each expert's copy of the dense weights


@torch.no_grad()
def mlp_inputs(dense: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's MLP inputs (the normed residual) on `ids`, as [tokens, hidden]."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].flatten(0, 1)))
        for layer in dense.model.layers
    ]
    dense(ids)
    for hook in hooks:
        hook.remove()
    return seen


@torch.no_grad()
def build(dense_dir: Path, out: Path, experts: int, top_k: int, bias: list[float]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM

    from llmq.calib.data import calibration_windows
    from llmq.calib.tokenizer import load_tokenizer

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    c = dense.config
    config = MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, num_local_experts=experts,
        num_experts_per_tok=top_k, sliding_window=None, hidden_act=c.hidden_act,
    )  # fmt: skip
    moe = MixtralForCausalLM(config).to(torch.float32)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, _ = moe.load_state_dict(state, strict=False)
    assert all(".mlp." in name for name in missing), missing
    # seed 1: other windows than the benchmarks' calibration (seed 0)
    probe = calibration_windows(load_tokenizer(dense_dir), "pydoc", num_samples=4, seq_len=512, seed=1)  # fmt: skip
    inputs = mlp_inputs(dense, probe.input_ids)
    generator = torch.Generator().manual_seed(0)
    for source, target, x in zip(dense.model.layers, moe.model.layers, inputs, strict=True):
        mlp, block = source.mlp, target.mlp
        weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        for e in range(experts):
            gate, up, down = (w * (1 + NOISE * torch.randn(w.shape, generator=generator)) for w in weights)  # fmt: skip
            block.experts.gate_up_proj[e] = torch.cat([gate, up])
            block.experts.down_proj[e] = down
        directions = torch.randn(experts, c.hidden_size, generator=generator)
        spread = float((x @ directions.T).std())
        mean = x.mean(0)
        toward_mean = mean / mean.pow(2).sum()
        block.gate.weight.copy_(directions / spread + torch.tensor(bias)[:, None] * toward_mean)
    moe.save_pretrained(out)
    AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--bias", default="0,0,-1,-3", help="router bias per expert, commas")
    args = parser.parse_args()
    from llmq.models import builtin_model_path

    bias = [float(b) for b in args.bias.split(",")]
    assert len(bias) == args.experts, "one bias per expert"
    build(builtin_model_path("smollm2-135m"), args.out, args.experts, args.top_k, bias)


if __name__ == "__main__":
    main()
