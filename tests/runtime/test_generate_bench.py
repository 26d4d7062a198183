"""`llmq generate` and `llmq bench`: greedy text equal to the dequantized model's, reports whose
numbers are the ratios they claim, and clear refusals of bad input."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.config import get_scheme
from llmq.errors import InputError
from llmq.io.checkpoint import open_checkpoint
from llmq.runtime.bench import Shape, bench_shapes
from llmq.runtime.generate import (
    GraphCaptureError,
    _StaticStep,
    graphed_greedy_decode,
    greedy_decode,
)
from llmq.runtime.load import load_dequantized
from tests.conftest import assert_bad_input

runner = CliRunner()
PROMPT = "The capital of France is"


@pytest.mark.integration
def test_generate_on_the_default_model_matches_the_dequantized_model(tmp_path, default_model):
    out = tmp_path / "w4a16"
    llmq.quantize(default_model, out, scheme="w4a16", num_samples=1, seq_len=64)
    result = runner.invoke(
        app, ["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", "12", "--json"]
    )
    assert result.exit_code == 0, result.output
    generated = json.loads(result.stdout)
    tokenizer = AutoTokenizer.from_pretrained(out)
    reference = greedy_decode(
        load_dequantized(open_checkpoint(out)),
        tokenizer(PROMPT, return_tensors="pt").input_ids,
        max_new_tokens=12,
        eos_token_id=tokenizer.eos_token_id,
    )
    assert generated["text"] == tokenizer.decode(reference.tokens, skip_special_tokens=True)
    assert generated["new_tokens"] == len(reference.tokens) and generated["kernels"] == "torch"
    assert len(generated["text"].split()) >= 3  # real words, not an empty continuation


def test_greedy_decode_uses_the_cache_like_a_full_forward(tiny_quantized) -> None:
    model = llmq.load_quantized(tiny_quantized("w4a16"))
    prompt = torch.randint(0, 49152, (1, 6), generator=torch.Generator().manual_seed(3))
    run = greedy_decode(model, prompt, max_new_tokens=5)
    ids = prompt
    for _ in range(5):  # no cache: the whole sequence each step
        with torch.no_grad():
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert run.tokens == ids[0, 6:].tolist()


def test_the_static_step_graphs_replay_decodes_what_the_dynamic_cache_does(tiny_quantized):
    """The step a CUDA graph records (a static KV cache; token and position in fixed buffers,
    advanced between calls) run eagerly here: the same tokens as greedy_decode."""
    from transformers import StaticCache

    model = llmq.load_quantized(tiny_quantized("w4a16"))
    prompt = torch.randint(0, 49152, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = greedy_decode(model, prompt, max_new_tokens=6).tokens
    with torch.inference_mode():
        cache = StaticCache(config=model.config, max_cache_len=6 + 6)
        token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, True)
        step = _StaticStep(model, cache, token, position=6)
        tokens = [int(token)] + [step.advance(step()) for _ in range(5)]
    assert tokens == expected


def test_graph_decode_needs_a_gpu(tiny_quantized) -> None:
    model = llmq.load_quantized(tiny_quantized("w4a16"))
    with pytest.raises(GraphCaptureError, match="needs a GPU"):
        graphed_greedy_decode(model, torch.zeros(1, 4, dtype=torch.long), max_new_tokens=8)


def test_bench_a_checkpoint(tiny_quantized) -> None:
    path = tiny_quantized("w4a16")
    result = runner.invoke(
        app, ["bench", str(path), "--batch-size", "1,3", "--prompt-tokens", "8", "--new-tokens", "3",
              "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["device"] == "cpu" and "no GPU" in report["note"]
    # tiny llama: q (192x192), k/v (64x192), o (192x192), gate/up (512x192), down (192x512)
    kinds = {(row["shape"].split("x", 1)[1], row["layers"]) for row in report["shapes"]}
    assert kinds == {("192x192", 4), ("64x192", 4), ("512x192", 4), ("192x512", 2)}
    assert sorted({row["shape"].split("x")[0] for row in report["shapes"]}) == ["1", "3"]
    for row in report["shapes"]:
        assert row["speedup"] == pytest.approx(row["dense_us"] / row["quantized_us"])
        assert row["roofline"] > 0
    e2e = report["end_to_end"]
    assert e2e["decode_speedup"] == pytest.approx(
        e2e["quantized_decode_tps"] / e2e["dense_decode_tps"]
    )
    assert e2e["prompt_tokens"] == 8 and e2e["new_tokens"] == 3
    assert e2e["quantized_graph_decode_tps"] is None and e2e["graph_decode_speedup"] is None
    assert report["load_seconds"] > 0


def test_bench_synthetic_shapes() -> None:
    cpu = torch.device("cpu")
    for scheme in ("w4a16", "w8a8", "fp8"):
        report = bench_shapes(
            [Shape.parse("2x96x256")], get_scheme(scheme), device=cpu, dtype=torch.float32,
            triton=False,
        )  # fmt: skip
        (row,) = report.shapes
        assert row.shape == "2x96x256" and row.layers == 0
        assert row.kernel == {"w4a16": "w4a16 g128", "w8a8": "w8a8 int8", "fp8": "w8a8 fp8"}[scheme]
    with pytest.raises(InputError, match="multiple of the group size"):
        bench_shapes([Shape(1, 64, 200)], get_scheme("w4a16"), device=cpu, dtype=torch.float32,
                     triton=False)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["bench"], "either a checkpoint or --shapes"),
        (["bench", "--shapes", "1x2"], "expected MxNxK"),
        (["bench", "--shapes", "0x2x3"], "at least 1"),
        (["bench", "--shapes", "1x64x256", "--scheme", "w5a16"], "unknown scheme"),
        (["bench", "--shapes", "1x64x256", "--batch-size", "a"], "comma-separated integers"),
        (["bench", "--shapes", "1x64x256", "--kernels", "cuda"], "not a kernel choice"),
        (["bench", "x", "--new-tokens", "1"], "--new-tokens 1"),
        (["generate", "missing-folder", "--prompt", "hi"], "no such folder"),
    ],
)
def test_bad_input_exits_2(args, fragment) -> None:
    assert_bad_input(runner.invoke(app, args), fragment)


def test_generate_bad_options(tiny_quantized, tiny_llama) -> None:
    path = str(tiny_quantized("w4a16"))
    assert_bad_input(
        runner.invoke(app, ["generate", path, "--prompt", "hi", "--max-new-tokens", "0"]),
        "--max-new-tokens 0",
    )
    assert_bad_input(
        runner.invoke(app, ["generate", str(tiny_llama), "--prompt", "hi"]), "no quantized linears"
    )
    assert_bad_input(
        runner.invoke(app, ["generate", path, "--prompt", "hi", "--device", "cuda"]), "no CUDA"
    )
