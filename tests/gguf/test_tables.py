"""GGUF's table types (IQ4_NL, IQ4_XS, MXFP4): bytes that gguf's reference dequantizer decodes
to llmq's values bit for bit, a scale search that beats the range-matching scale and gguf's own
MXFP4 quantizer, the iq4_xs scheme's mix, and files transformers and llama.cpp read."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.gguf.export import plan_tensors
from llmq.gguf.mix import get_gguf_scheme
from llmq.gguf.tables import TABLES, choose_table_grid, pack_table, table_codes, table_dequantized
from llmq.io.checkpoint import open_checkpoint
from tests.conftest import assert_bad_input, make_tiny
from tests.gguf.families import needs_llama_cpp
from tests.gguf.test_blocks import awkward_weights, sqnr, weighted_error

TYPES = [q.name for q in TABLES]
SQNR_FLOOR = {"IQ4_NL": 20.5, "IQ4_XS": 20.5, "MXFP4": 17.0}  # dB on N(0, 1) weights


def encoded(qtype: str, w: np.ndarray, importance: np.ndarray | None = None):
    grid = choose_table_grid(GGMLQuantizationType[qtype], w, importance)
    codes = table_codes(grid, w)
    return grid, codes, table_dequantized(grid, codes)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "importance"])
@pytest.mark.parametrize("qtype", TYPES)
def test_packed_bytes_decode_to_our_values_bit_for_bit(qtype: str, weighted: bool) -> None:
    w = awkward_weights()
    importance = np.random.default_rng(1).uniform(0.01, 3, w.shape[1]) if weighted else None
    grid, codes, values = encoded(qtype, w, importance)
    packed = pack_table(grid, codes)
    assert packed.shape[1] * w.shape[0] == packed.size  # whole blocks
    decoded = gguf.quants.dequantize(packed, GGMLQuantizationType[qtype]).reshape(w.shape)
    np.testing.assert_array_equal(decoded, values)
    assert np.all(values[5, :256] == 0) and np.all(values[1, :256] == 0)  # zeros stay zeros


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_search_beats_the_range_matching_scale_and_meets_its_sqnr(qtype: str) -> None:
    """The searched scales' importance-weighted error is below that of the scale putting each
    group's largest weight on the table's end; SQNR above the type's floor. (MXFP4's scales are
    powers of two: it is held to gguf's own quantizer below.)"""
    rng = np.random.default_rng(2)
    w = rng.normal(0, 1, (64, 512)).astype(np.float32)
    importance = rng.uniform(0.1, 3, 512)
    _, _, searched = encoded(qtype, w, importance)
    table = TABLES[GGMLQuantizationType[qtype]]
    groups = w.reshape(-1, 32)
    extreme = groups[np.arange(len(groups)), np.abs(groups).argmax(-1)]
    scale = extreme / np.where(extreme < 0, table.min(), table.max())
    plain = scale[:, None] * table[np.abs(groups[..., None] / scale[:, None, None] - table).argmin(-1)]  # fmt: skip
    assert weighted_error(w, searched, importance) < 0.97 * weighted_error(w, plain.reshape(w.shape), importance)  # fmt: skip
    assert sqnr(w, searched) > SQNR_FLOOR[qtype]


def test_mxfp4_error_below_ggufs_reference_quantizer() -> None:
    """gguf's MXFP4 quantizer takes each block's exponent from its largest weight; the search
    tries its neighbours too: lower error on awkward and on normal weights, SQNR above the floor."""
    for w in (awkward_weights(seed=3), np.random.default_rng(4).normal(0, 1, (64, 512)).astype(np.float32)):  # fmt: skip
        _, _, ours = encoded("MXFP4", w)
        theirs = gguf.quants.dequantize(gguf.quants.quantize(w, GGMLQuantizationType.MXFP4), GGMLQuantizationType.MXFP4)  # fmt: skip
        assert np.sum((ours - w) ** 2.0) < np.sum((theirs.reshape(w.shape) - w) ** 2.0)
    assert sqnr(w, ours) > SQNR_FLOOR["MXFP4"]


def test_iq4_xs_mix_follows_llama_cpp(tmp_path, default_model) -> None:
    """IQ4_XS on rows of whole 256-blocks, IQ4_NL on the others (192 columns); attn_v at Q5_K
    where 4 query heads share a key head; the early ffn_down at Q5_K without an imatrix only;
    the tied output at Q6_K."""
    source = make_tiny(tmp_path / "m", default_model, hidden=256, heads=4, kv_heads=1, layers=8)
    ckpt = open_checkpoint(source)
    scheme = get_gguf_scheme("iq4_xs")
    plain = {t.name: t.qtype.name for t in plan_tensors(ckpt, scheme, has_imatrix=False)}
    assert plain["blk.3.attn_q.weight"] == "IQ4_XS" and plain["blk.3.attn_v.weight"] == "Q5_K"
    assert plain["blk.0.ffn_down.weight"] == "Q5_K" and plain["blk.1.ffn_down.weight"] == "IQ4_XS"
    assert plain["token_embd.weight"] == "Q6_K"
    weighted = {t.name: t.qtype.name for t in plan_tensors(ckpt, scheme, has_imatrix=True)}
    assert weighted["blk.0.ffn_down.weight"] == "IQ4_XS"
    narrow = open_checkpoint(make_tiny(tmp_path / "n", default_model, hidden=192))
    fallback = {t.name: t.qtype.name for t in plan_tensors(narrow, scheme)}
    assert fallback["blk.0.attn_q.weight"] == "IQ4_NL"


@pytest.mark.integration
def test_an_iq4_xs_file_loads_in_transformers_with_the_models_logits(tmp_path, default_model) -> None:  # fmt: skip
    source = make_tiny(tmp_path / "m", default_model, hidden=256, heads=4, kv_heads=2)
    out = tmp_path / "m.gguf"
    llmq.quantize(source, out, format="gguf", scheme="iq4_xs", num_samples=2, seq_len=32)
    types = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert {"IQ4_XS", "F32"} <= types
    result = CliRunner().invoke(app, ["verify", str(out), "--loader", "transformers", "--json"])
    assert result.exit_code == 0, result.output


def test_gptq_on_a_table_type_is_refused(tmp_path, tiny_llama) -> None:
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "-o", str(tmp_path / "m.gguf"), "--format", "gguf", "--scheme", "iq4_xs", "--method", "gptq"])  # fmt: skip
    assert_bad_input(result, "GPTQ's error feedback runs on uniform grids")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.integration
@needs_llama_cpp
def test_llama_cpp_runs_the_table_types(tmp_path, default_model) -> None:
    """An iq4_xs file (IQ4_XS, IQ4_NL where rows are 192 wide) and MXFP4 tensors computed by
    llama.cpp as llmq's evaluator computes the file's tensors."""
    source = make_tiny(tmp_path / "m", default_model, hidden=256, heads=4, kv_heads=2)
    for scheme, types in (("iq4_xs", ()), ("q8_0", ("blk.*.ffn_*.weight=mxfp4",))):
        out = tmp_path / f"{scheme}.gguf"
        llmq.quantize(source, out, format="gguf", scheme=scheme, imatrix="none", tensor_type=types)
        result = CliRunner().invoke(app, ["verify", str(out), "--loader", "llama.cpp", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["loaders"][0]["comparison"]["distance"]["mean_abs"] < 0.05
