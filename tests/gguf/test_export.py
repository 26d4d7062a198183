"""GGUF export end to end: what transformers' GGUF reader (which dequantizes with the gguf
package) loads from llmq's file is the model llmq meant to write; the per-tensor types follow
llama.cpp's mixes; importance matrices round-trip; bad input is one line."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import Tensor

import llmq
from llmq.errors import InputError
from llmq.gguf.export import plan_tensors, written_by_llmq
from llmq.gguf.imatrix import Imatrix, read_imatrix, save_imatrix
from llmq.gguf.mix import get_gguf_scheme
from llmq.gguf.model import permute_rotary_rows
from llmq.io.checkpoint import open_checkpoint
from tests.conftest import assert_bad_input, make_tiny


def _tiny(tmp_path: Path, default_model: Path, model_type: str, **fields: object) -> Path:
    """A tiny random model of `model_type` with 256-wide rows (whole K-quant super-blocks)."""
    extra = {"head_dim": 128} if model_type == "qwen3" else {}  # transformers' Qwen3 GGUF reads 128
    return make_tiny(
        tmp_path / model_type, default_model, model_type=model_type, hidden=256, heads=4,
        kv_heads=2, **{**extra, **fields},
    )  # fmt: skip


def _reference_weights(path: Path, heads: int, kv_heads: int, llama: bool) -> dict[str, Tensor]:
    """Each tensor of the GGUF file dequantized by the gguf package's own code, q/k rows put
    back in Hugging Face's order for the llama architecture; by GGUF name."""
    weights = {}
    for tensor in gguf.GGUFReader(path).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = values.reshape([int(n) for n in reversed(tensor.shape)])
        if llama and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            group = heads if "attn_q" in tensor.name else kv_heads
            values = _unpermute(values, group)
        weights[tensor.name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return weights


def _unpermute(values: np.ndarray, heads: int) -> np.ndarray:
    half = values.shape[0] // heads // 2
    return values.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(values.shape)


DATA_FREE = {"imatrix": "none"}
GPTQ = {"method": "gptq", "num_samples": 4, "seq_len": 32}


@pytest.mark.parametrize(
    ("model_type", "scheme", "options", "bound"),
    [
        ("llama", "q8_0", DATA_FREE, 0.01),
        ("llama", "q4_k_m", DATA_FREE, 0.12),
        ("llama", "q4_k_m", GPTQ, 0.15),  # GPTQ trades weight error for output error
        ("qwen3", "q6_k", DATA_FREE, 0.04),
    ],
    ids=["llama-q8_0", "llama-q4_k_m", "llama-q4_k_m-gptq", "qwen3-q6_k"],
)
@pytest.mark.integration
def test_transformers_loads_the_model_llmq_meant(
    tmp_path: Path, default_model: Path, model_type: str, scheme: str, options: dict, bound: float
) -> None:
    """transformers' GGUF loader gives the logits of the float model with every weight replaced
    by its reference-dequantized value (names, q/k order and hyperparameters all right), each
    weight within the type's error, and the same token ids from the file's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _tiny(tmp_path, default_model, model_type)
    out = tmp_path / f"{model_type}-{scheme}.gguf"
    result = llmq.quantize(source, out, format="gguf", scheme=scheme, **options)
    assert out.is_file() and written_by_llmq(out)
    assert (result.importance is None) == (options is DATA_FREE)

    float_model = AutoModelForCausalLM.from_pretrained(source).eval()
    config = float_model.config
    ckpt = open_checkpoint(source)
    names = {t.sources[0]: t.name for t in plan_tensors(ckpt, get_gguf_scheme(scheme))}
    reference = _reference_weights(
        out, config.num_attention_heads, config.num_key_value_heads, model_type == "llama"
    )
    state = float_model.state_dict()
    for source_name, gguf_name in names.items():
        original, decoded = state[source_name], reference[gguf_name]
        if original.dim() == 2:
            error = float((decoded - original).norm() / original.norm())
            assert error < bound, (gguf_name, error)
        state[source_name] = decoded
    float_model.load_state_dict(state)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name).eval()
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = float_model(ids).logits, loaded(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    text = "def quantize(model):\n    return 'GGUF' + \" files\"  # 42"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(source)(text)["input_ids"]


@pytest.mark.integration
def test_mixes_raise_attn_v_and_ffn_down_where_llama_cpp_does(
    tmp_path: Path, default_model: Path
) -> None:
    """q4_k_m on 8 layers: attn_v and ffn_down at Q6_K in layers 0, 3, 6 and 7 (the first and
    last eighth, every third between), the tied output at Q6_K; q4_k_s raises attn_v in the
    first four layers and ffn_down in the first eighth to Q5_K; rows of 192 (not whole
    256-blocks) fall back to Q5_0, norms stay F32."""
    ckpt = open_checkpoint(_tiny(tmp_path, default_model, "llama", layers=8))
    types = {t.name: t.qtype.name for t in plan_tensors(ckpt, get_gguf_scheme("q4_k_m"))}
    raised = {i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"}
    assert raised == {i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"}
    assert raised == {0, 3, 6, 7}
    assert types["token_embd.weight"] == "Q6_K" and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.1.attn_q.weight"] == types["blk.1.ffn_up.weight"] == "Q4_K"
    small = {t.name: t.qtype.name for t in plan_tensors(ckpt, get_gguf_scheme("q4_k_s"))}
    assert {i for i in range(8) if small[f"blk.{i}.attn_v.weight"] == "Q5_K"} == {0, 1, 2, 3}
    assert {i for i in range(8) if small[f"blk.{i}.ffn_down.weight"] == "Q5_K"} == {0}
    narrow = open_checkpoint(make_tiny(tmp_path / "narrow", default_model, hidden=192))
    fallback = {t.name: t.qtype.name for t in plan_tensors(narrow, get_gguf_scheme("q4_k_m"))}
    assert fallback["blk.0.attn_q.weight"] == "Q5_0"  # 192 inputs: no whole super-block
    assert fallback["blk.1.ffn_down.weight"] == "Q6_K"  # 512 inputs: the last layer raised


def test_permuted_rows_interleave_each_heads_halves() -> None:
    """Row h·d + 2i + j of the permuted weight is row h·d + j·d/2 + i of the original."""
    heads, d = 3, 8
    weight = np.arange(heads * d * 2, dtype=np.float32).reshape(heads * d, 2)
    permuted = permute_rotary_rows(weight, heads)
    for h in range(heads):
        for i in range(d // 2):
            for j in range(2):
                assert np.array_equal(permuted[h * d + 2 * i + j], weight[h * d + j * d // 2 + i])


def test_imatrix_files_round_trip(tmp_path: Path) -> None:
    """Plain weights and stacked experts (a row of sums and a count per expert, as llama.cpp
    writes a mixture's): the file holds what was written, each row divided by its count."""
    experts = "blk.0.ffn_down_exps.weight"
    sums = {
        "blk.0.attn_q.weight": np.array([1.0, 4.0, 9.0]), "output.weight": np.ones(5),
        experts: np.array([[2.0, 4.0], [3.0, 9.0]]),
    }  # fmt: skip
    counts = {"blk.0.attn_q.weight": np.array([2.0]), "output.weight": np.array([5.0]), experts: np.array([2.0, 3.0])}  # fmt: skip
    save_imatrix(tmp_path / "m.imatrix", Imatrix(sums, counts, "llama", ("t",)))
    read = read_imatrix(tmp_path / "m.imatrix")
    assert read.datasets == ("t",) and sorted(read.counts) == sorted(counts)
    for name in counts:
        np.testing.assert_array_equal(read.counts[name], counts[name])
        np.testing.assert_array_equal(read.sums[name], sums[name])
    importance = read.importance()
    np.testing.assert_array_equal(importance["blk.0.attn_q.weight"], [0.5, 2.0, 4.5])
    np.testing.assert_array_equal(importance["output.weight"], np.full(5, 0.2, np.float32))
    np.testing.assert_array_equal(importance[experts], [[1.0, 2.0], [1.0, 3.0]])


@pytest.mark.integration
def test_importance_from_calibration_weighs_the_export(tmp_path: Path, default_model: Path) -> None:
    """`calibrate --imatrix` names every linear by its GGUF name, with one positive value per
    input channel, and exporting with that file gives the bytes of computing it in the export."""
    source = _tiny(tmp_path, default_model, "llama")
    imatrix_file = tmp_path / "tiny.imatrix"
    made = llmq.quantize(source, tmp_path / "a.gguf", format="gguf", num_samples=2, seq_len=32)
    written = llmq.calibrate(source, imatrix_file, imatrix=True, num_samples=2, seq_len=32)
    imatrix = read_imatrix(imatrix_file)
    assert written.linears == len(imatrix.sums) == 14
    assert sorted(imatrix.sums) == sorted(
        f"blk.{i}.{kind}.weight" for i in range(2)
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    )  # fmt: skip
    assert all((values > 0).all() for values in imatrix.sums.values())
    assert all(c.tolist() == [64.0] for c in imatrix.counts.values())  # 2 windows of 32 tokens
    again = llmq.quantize(source, tmp_path / "b.gguf", format="gguf", imatrix=str(imatrix_file))
    assert made.importance is not None and again.importance == str(imatrix_file)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    plain = llmq.quantize(source, tmp_path / "c.gguf", format="gguf", imatrix="none")
    assert plain.importance is None
    assert (tmp_path / "c.gguf").read_bytes() != (tmp_path / "a.gguf").read_bytes()


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--scheme", "q3_k_xl"], "--scheme q3_k_xl: not a GGUF scheme"),
        (["--method", "awq"], "--method awq: GGUF export takes rtn or gptq"),
        (["--method", "gptq"], "--method gptq: its Hessians come from the calibration pass"),
        (["--group-size", "64"], "--group-size: not an option of --format gguf"),
        (["--tensor-type", "blk.*"], "expected PATTERN=TYPE"),
        (["--tensor-type", "blk.*=q9_k"], "'q9_k': not one llmq writes"),
    ],
)
def test_bad_gguf_options_exit_2(
    tmp_path: Path, tiny_llama: Path, extra: list[str], fragment: str
) -> None:
    from tests.cli.test_cli import run

    result = run("quantize", str(tiny_llama), "--out", str(tmp_path / "m.gguf"), "--format", "gguf", "--imatrix", "none", *extra)  # fmt: skip
    assert_bad_input(result, fragment)
    assert not (tmp_path / "m.gguf").exists()


def test_a_file_llmq_did_not_write_is_never_replaced(tmp_path: Path, tiny_llama: Path) -> None:
    from tests.cli.test_cli import run

    users = tmp_path / "mine.gguf"
    users.write_bytes(b"a user's own file")
    result = run("quantize", str(tiny_llama), "--out", str(users), "--format", "gguf", "--imatrix", "none", "--overwrite")  # fmt: skip
    assert_bad_input(result, "not a GGUF file llmq wrote")
    assert users.read_bytes() == b"a user's own file"


def test_a_family_without_a_gguf_mapping_is_one_line(tmp_path: Path, default_model: Path) -> None:
    """Granite: llmq reads it (its layout discovered), llama.cpp has a granite of its own that
    llmq does not write."""
    granite = make_tiny(tmp_path / "granite", default_model, model_type="granite", hidden=256, heads=4)  # fmt: skip
    with pytest.raises(InputError, match="model_type 'granite': no GGUF mapping"):
        llmq.quantize(granite, tmp_path / "g.gguf", format="gguf", imatrix="none")


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")}}
# DeepSeek-V3's tokenizer.json: digit triples split first (as Llama 3's), then CJK runs, then words
DEEPSEEK_V3 = [
    {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}"}},
    {
        "type": "Split",
        "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"},
    },  # CJK, kana
    {"type": "Split", "pattern": {"Regex": r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}},
    {"type": "ByteLevel"},
]


@pytest.mark.parametrize(
    ("pre_tokenizer", "name"),
    [
        ({"type": "ByteLevel", "use_regex": True}, "gpt-2"),
        ({"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}}, "llama-bpe"),
        ({"type": "Sequence", "pretokenizers": [QWEN2, {"type": "ByteLevel"}]}, "qwen2"),
        ({"type": "Sequence", "pretokenizers": DEEPSEEK_V3}, "deepseek-v3"),
    ],
)
def test_the_pre_tokenizer_is_named_from_its_split(pre_tokenizer: dict, name: str) -> None:
    from llmq.gguf.tokenizer import pre_tokenizer_name

    assert pre_tokenizer_name({"pre_tokenizer": pre_tokenizer}) == name


def test_an_unknown_split_is_refused_not_guessed() -> None:
    from llmq.gguf.tokenizer import pre_tokenizer_name

    with pytest.raises(InputError, match="regex llmq does not know"):
        pre_tokenizer_name({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"\w+"}}})


def test_an_output_that_cannot_be_written_is_one_line(tmp_path: Path, tiny_llama: Path) -> None:
    from tests.cli.test_cli import run

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = run("quantize", str(tiny_llama), "--out", str(blocker / "m.gguf"), "--format", "gguf", "--imatrix", "none")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "error:" in result.output
    assert blocker.read_text() == "not a folder"


def test_bad_imatrix_files_and_formats_exit_2_and_stay_unchanged(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """--imatrix: a missing file, a file that is no GGUF, an imatrix of another model;
    --format: an unknown one; calibrate --imatrix: a name that is no imatrix file. Each is one
    error line, exit 2, nothing written, the inputs as they were."""
    from tests.cli.test_cli import run

    out = tmp_path / "m.gguf"
    text = tmp_path / "notes.txt"
    text.write_text("not an imatrix")
    other = tmp_path / "other.imatrix"
    save_imatrix(
        other, Imatrix({"blk.99.attn_q.weight": np.ones(3)}, {"blk.99.attn_q.weight": np.ones(1)})
    )
    other_bytes = other.read_bytes()
    cases = [
        (["--imatrix", str(tmp_path / "absent.imatrix")], "absent.imatrix"),
        (["--imatrix", str(text)], "not a readable GGUF imatrix file"),
        (["--imatrix", str(other)], "names none of this model's tensors"),
        (["--format", "onnx"], "format"),
    ]
    for extra, fragment in cases:
        args = ["quantize", str(tiny_llama), "--out", str(out)]
        args += extra if extra[0] == "--format" else ["--format", "gguf", *extra]
        assert_bad_input(run(*args), fragment)
        assert not out.exists()
    assert text.read_text() == "not an imatrix" and other.read_bytes() == other_bytes
    result = run("calibrate", str(tiny_llama), "--out", str(text), "--imatrix")
    assert_bad_input(result, "an imatrix is a GGUF file")
    assert text.read_text() == "not an imatrix"
