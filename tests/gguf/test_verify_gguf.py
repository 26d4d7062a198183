"""`llmq verify FILE.gguf`: transformers' GGUF reader is held to the model the file's tensors
define on its source's architecture; a file whose metadata misstates the model fails. Mixtures of
experts (Qwen3-MoE) are written with each role's experts stacked, as llama.cpp reads them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.gguf import model as gguf_model
from llmq.gguf.imatrix import read_imatrix
from tests.conftest import TINY_EXPERTS, assert_bad_input, make_tiny, sharpen


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """A tiny Llama with 256-wide rows (whole K-quant super-blocks) and peaked distributions, so
    that a wrong hyperparameter moves the log-probabilities well past the tolerance."""
    folder = make_tiny(tmp_path_factory.mktemp("verify-gguf") / "llama", default_model, hidden=256, heads=4, kv_heads=2)  # fmt: skip
    return sharpen(folder)


def verified(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["verify", *args, "--json"])
    return result.exit_code, json.loads(result.stdout) if result.exit_code in (0, 1) else {}


@pytest.mark.integration
def test_a_file_llmq_wrote_passes_against_the_source_it_records(
    tmp_path: Path, source: Path
) -> None:
    out = tmp_path / "model.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q4_k_m", imatrix="none")
    code, report = verified(str(out), "--baseline", str(source), "--loader", "transformers")
    assert code == 0 and report["passed"]
    [loader] = report["loaders"]
    assert loader["loader"] == "transformers" and loader["status"] == "ok"
    assert str(source) in report["reference"]
    assert (
        report["against"]["max_abs"] > loader["comparison"]["distance"]["max_abs"]
    )  # 4 bits moved it


@pytest.mark.integration
def test_metadata_that_misstates_the_model_fails_with_wrong_logits(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rotary base written 100x too small: the tensors are right, the model is not."""
    real = gguf_model.rope_of
    monkeypatch.setattr(
        gguf_model, "rope_of", lambda config: gguf_model.Rope(real(config).theta / 100)
    )
    out = tmp_path / "wrong-rope.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    code, report = verified(str(out), "--loader", "transformers")
    assert code == 1 and not report["passed"]
    [loader] = report["loaders"]
    assert loader["status"] == "wrong logits"


def test_what_verify_cannot_hold_a_gguf_file_to_is_one_line(tmp_path: Path, source: Path) -> None:
    out = tmp_path / "model.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q8_0", imatrix="none")
    runner = CliRunner()
    assert_bad_input(runner.invoke(app, ["verify", str(out), "--loader", "llmq"]), "--loader llmq: a GGUF file is verified with transformers")  # fmt: skip
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model")
    assert_bad_input(runner.invoke(app, ["verify", str(not_gguf)]), "not a folder or a GGUF file")
    other = tmp_path / "other"
    other.mkdir()
    make_tiny(other / "llama", source, hidden=192)
    assert_bad_input(runner.invoke(app, ["verify", str(out), "--baseline", str(other / "llama")]), "token_embd.weight is [49152, 256], model.embed_tokens.weight")  # fmt: skip


# transformers' GGUF reader takes a mixture's expert widths from its config defaults, not from
# the file: the tiny mixtures use them (Qwen3-MoE 768; Qwen2-MoE 1408, its shared expert 5632),
# and llama.cpp's routing: renormalized top-2 for qwen3moe, not for qwen2moe
MIXTURES = {
    "qwen3_moe": {
        **TINY_EXPERTS["qwen3_moe"],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "head_dim": 128,
    },
    "qwen2_moe": {  # llama.cpp's qwen2moe reads its own output.weight: untied
        **TINY_EXPERTS["qwen2_moe"],
        "tied": False,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "head_dim": 64,
    },
}


def tiny_mixture(folder: Path, default_model: Path, family: str = "qwen3_moe", **fields: object) -> Path:  # fmt: skip
    config = {**MIXTURES[family], **fields}
    return make_tiny(folder, default_model, model_type=family, hidden=256, heads=4, kv_heads=2, **config)  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(MIXTURES))
def test_a_mixtures_experts_are_stacked_per_role_and_transformers_reads_them(
    tmp_path: Path, default_model: Path, family: str
) -> None:
    """Each layer's experts of a role in one 3-D tensor, in expert order (transformers splits
    them its own way and computes the reference), block scales searched against a per-expert
    importance matrix (a row and a count per expert, as llama.cpp's imatrix files hold them);
    Qwen2-MoE's shared expert as its own tensors, its gate a vector."""
    source = tiny_mixture(tmp_path / "moe", default_model, family)
    width = MIXTURES[family]["moe_intermediate_size"]
    imatrix_file = tmp_path / "moe.imatrix"
    llmq.calibrate(source, imatrix_file, imatrix=True, num_samples=2, seq_len=32)
    imatrix = read_imatrix(imatrix_file)
    assert imatrix.sums["blk.0.ffn_down_exps.weight"].shape == (4, width)
    assert imatrix.counts["blk.0.ffn_gate_exps.weight"].tolist() == [64.0] * 4  # every token
    out = tmp_path / "moe.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q4_k_m", imatrix=str(imatrix_file))
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert [int(n) for n in reversed(tensors["blk.0.ffn_gate_exps.weight"].shape)] == [
        4,
        width,
        256,
    ]
    assert [int(n) for n in reversed(tensors["blk.1.ffn_down_exps.weight"].shape)] == [
        4,
        256,
        width,
    ]
    if family == "qwen2_moe":
        assert [int(n) for n in tensors["blk.0.ffn_gate_inp_shexp.weight"].shape] == [256]
    # raised where llama.cpp raises ffn_down: the last eighth of the layers (here layer 1);
    # 1408 columns are not whole K-quant super-blocks: llama.cpp's fallbacks
    assert (
        tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    )  # the router, as llama.cpp
    down_types = [tensors[f"blk.{i}.ffn_down_exps.weight"].tensor_type.name for i in range(2)]
    assert down_types == (["Q4_K", "Q6_K"] if width % 256 == 0 else ["Q5_0", "Q8_0"])
    code, report = verified(str(out))
    assert code == 0 and report["loaders"][0]["status"] == "ok"


def test_what_a_gguf_mixture_cannot_be_is_refused_in_one_line(tmp_path: Path, default_model: Path) -> None:  # fmt: skip
    runner = CliRunner()
    unnormalized = tiny_mixture(tmp_path / "plain", default_model, norm_topk_prob=False)
    routed = runner.invoke(app, ["quantize", str(unnormalized), "-o", str(tmp_path / "b.gguf"), "--format", "gguf"])  # fmt: skip
    assert_bad_input(routed, "norm_topk_prob false")
    tied = tiny_mixture(tmp_path / "tied", default_model, "qwen2_moe", tied=True)
    no_head = runner.invoke(app, ["quantize", str(tied), "-o", str(tmp_path / "c.gguf"), "--format", "gguf"])  # fmt: skip
    assert_bad_input(
        no_head, "tie_word_embeddings true: llama.cpp's qwen2moe reads a separate output.weight"
    )
    assert not any(tmp_path.glob("*.gguf"))


@pytest.mark.integration
def test_gptq_rounds_each_stacked_expert_with_its_own_hessian(tmp_path: Path, default_model: Path) -> None:  # fmt: skip
    """--method gptq on a mixture: each expert's share of ffn_down_exps holds GPTQ's codes on its
    own grid with the Hessian of its own inputs (llmq's calibration runs every token through
    every expert, so gate/up share theirs; another expert's down Hessian gives other bytes), and
    transformers' reader computes the file's model."""
    import numpy as np

    from llmq.calib.collect import collect_stats
    from llmq.calib.windows import model_windows
    from llmq.config import CalibConfig
    from llmq.gguf.blocks import pack
    from llmq.gguf.gptq import gptq_codes
    from llmq.gguf.grids import choose_grid
    from llmq.gguf.imatrix import imatrix_from_stats
    from llmq.io.checkpoint import open_checkpoint

    source = tiny_mixture(tmp_path / "moe", default_model)
    out = tmp_path / "moe-gptq.gguf"
    llmq.quantize(source, out, format="gguf", scheme="q4_k_m", method="gptq", num_samples=4, seq_len=32)  # fmt: skip
    ckpt = open_checkpoint(source)
    calibration = CalibConfig(num_samples=4, seq_len=32)
    windows = model_windows(source, calibration)
    stats = collect_stats(ckpt, windows.input_ids, hessian=True, norms=True)
    hessians = {f"{linear}.weight": s.hessian for linear, s in stats.inputs.items()}
    importance = imatrix_from_stats(ckpt, stats, calibration).importance()["blk.1.ffn_down_exps.weight"]  # fmt: skip
    [stacked] = [t for t in gguf.GGUFReader(out).tensors if t.name == "blk.1.ffn_down_exps.weight"]

    def expected(expert: int, hessian_of: int) -> np.ndarray:
        weight = ckpt.read(f"model.layers.1.mlp.experts.{expert}.down_proj.weight").float().numpy()
        grid = choose_grid(stacked.tensor_type, weight, importance[expert])
        hessian = hessians[f"model.layers.1.mlp.experts.{hessian_of}.down_proj.weight"]
        return pack(grid, gptq_codes(grid, weight, hessian))

    for expert in range(4):
        assert np.array_equal(np.asarray(stacked.data[expert]), expected(expert, expert)), expert
    assert not np.array_equal(np.asarray(stacked.data[1]), expected(1, 0))
    code, report = verified(str(out), "--loader", "transformers")
    assert code == 0 and report["loaders"][0]["status"] == "ok"
