"""GGUF types to a budget (`quantize --format gguf --target-bits B`): the bits a weight counted
from the written file never exceed B and equal the prediction; each tensor's damage is what the
gguf package's own dequantizer reads back from the file; the choice is the brute-force optimum
of the recorded damages; pinned tensors keep their type; experts stack under one type; llama.cpp
and transformers read the file; bad budgets are one line."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest

import llmq
from llmq.gguf.export import plan_tensors
from llmq.gguf.mix import get_gguf_scheme
from llmq.io.checkpoint import Checkpoint, open_checkpoint
from tests.conftest import assert_bad_input
from tests.gguf.families import needs_llama_cpp, tiny, verified

DATA_FREE = {"imatrix": "none", "sensitivity": "weight"}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return tiny(tmp_path_factory.mktemp("budget") / "llama", default_model, "llama", layers=3)


def _sources(model: Path) -> dict[str, tuple[str, ...]]:
    """Each GGUF tensor's checkpoint sources (module names)."""
    plan = plan_tensors(open_checkpoint(model), get_gguf_scheme("q4_k_m"))
    return {t.name: tuple(s.removesuffix(".weight") for s in t.sources) for t in plan}


def _file_tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _unpermute(values: np.ndarray, heads: int) -> np.ndarray:
    half = values.shape[0] // heads // 2
    return values.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(values.shape)


@pytest.mark.parametrize("target", [4.8, 5.6])
def test_the_budget_holds_in_the_file_and_each_damage_is_what_it_reads_back(
    tmp_path: Path, tiny_llama: Path, target: float
) -> None:
    out = tmp_path / f"mixed-{target}.gguf"
    result = llmq.quantize(tiny_llama, out, format="gguf", target_bits=target, **DATA_FREE)
    record = result.mixed_precision
    sources = _sources(tiny_llama)
    tensors = _file_tensors(out)
    decoder = {name for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2}  # fmt: skip
    stored = sum(8 * int(tensors[name].n_bytes) for name in decoder)
    weights = sum(int(np.prod(tensors[name].shape)) for name in decoder)
    assert stored / weights == record["written_bits"] == pytest.approx(record["predicted_bits"])
    assert record["written_bits"] <= target
    ckpt = open_checkpoint(tiny_llama)
    types = set()
    for name in decoder:
        [linear] = sources[name]
        entry = record["linears"][linear]
        tensor = tensors[name]
        assert tensor.tensor_type.name == entry["stored_as"]
        types.add(entry["stored_as"])
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
            [int(n) for n in reversed(tensor.shape)]
        )
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            values = _unpermute(values, 4 if "attn_q" in name else 2)
        weight = ckpt.read(f"{linear}.weight").double().numpy()
        reference = float(np.square(values.astype(np.float64) - weight).sum())
        assert entry["damage"] == pytest.approx(reference, rel=1e-4)
    assert len(types) > 1  # a mix, not one type everywhere


def test_max_size_bounds_the_files_tensors(tmp_path: Path, tiny_llama: Path) -> None:
    """--max-size counts every tensor of the file (embedding and output at the scheme's types):
    the least size the refusal names is enough, and exactly what the cheapest choice writes;
    a byte less is refused; between that and the dearest, the file's tensors fit."""
    from tests.cli.test_cli import run

    flags = ["--format", "gguf", "--imatrix", "none", "--sensitivity", "weight"]
    refused = run("quantize", str(tiny_llama), "--out", str(tmp_path / "x.gguf"), *flags, "--max-size", "1000")  # fmt: skip
    assert_bad_input(refused, "the cheapest candidates write")
    least = int(re.search(r"write (\d+) bytes", refused.output).group(1))  # type: ignore[union-attr]
    for size in (least, least + 40_000):
        out = tmp_path / f"m{size}.gguf"
        result = llmq.quantize(tiny_llama, out, format="gguf", max_size=size, **DATA_FREE)
        written = sum(int(t.n_bytes) for t in gguf.GGUFReader(out).tensors)
        assert written == result.mixed_precision["written_bytes"] <= size
        if size == least:
            assert written == least
            assert {e["candidate"] for e in result.mixed_precision["linears"].values()} == {"q4_k"}
    assert result.mixed_precision["written_bits"] > 4.5  # the larger size bought bits
    over = run("quantize", str(tiny_llama), "--out", str(tmp_path / "y.gguf"), *flags, "--max-size", str(least - 1))  # fmt: skip
    assert_bad_input(over, f"the cheapest candidates write {least} bytes")


def test_the_choice_is_the_brute_force_optimum(tmp_path: Path, tiny_llama: Path) -> None:
    """Two candidates; the last layer and one query tensor pinned: every combination of the
    other 13 tensors tried against the recorded damages and the bytes each type writes."""
    out = tmp_path / "two.gguf"
    pins = ("blk.0.attn_q.weight=q6_k", "blk.2.*=q5_k")
    result = llmq.quantize(
        tiny_llama, out, format="gguf", target_bits=6.0, candidates=("q4_k", "q8_0"),
        tensor_type=pins, **DATA_FREE,
    )  # fmt: skip
    record = result.mixed_precision
    tensors = _file_tensors(out)
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q6_K"
    assert tensors["blk.2.ffn_down.weight"].tensor_type.name == "Q5_K"
    ckpt = open_checkpoint(tiny_llama)
    linears = list(record["linears"])
    assert len(linears) == 13 and not any(".layers.2." in n for n in linears)
    numel = {n: int(np.prod(ckpt.tensors[f"{n}.weight"].shape)) for n in _all_linears(ckpt)}
    bits = {
        "q4_k": 8 * 144 / 256,
        "q5_k": 8 * 176 / 256,
        "q6_k": 8 * 210 / 256,
        "q8_0": 8 * 34 / 32,
    }
    pinned = bits["q6_k"] * numel["model.layers.0.self_attn.q_proj"] + bits["q5_k"] * sum(
        size for name, size in numel.items() if ".layers.2." in name
    )
    budget = 6.0 * sum(numel.values())
    best = None
    for options in itertools.product(("q4_k", "q8_0"), repeat=len(linears)):
        cost = pinned + sum(bits[o] * numel[n] for n, o in zip(linears, options, strict=True))
        if cost > budget:
            continue
        damage = sum(record["linears"][n]["damages"][o] for n, o in zip(linears, options, strict=True))  # fmt: skip
        if best is None or damage < best[0]:
            best = (damage, options)
    assert best is not None
    chosen = tuple(record["linears"][n]["candidate"] for n in linears)
    assert record["predicted_damage"] == pytest.approx(best[0], rel=1e-9)
    assert chosen == best[1]


def _all_linears(ckpt: Checkpoint) -> list[str]:
    return [name for index in range(ckpt.num_layers) for name in ckpt.layout.linear_names(index)]


def test_gptq_writes_the_chosen_types(tmp_path: Path, tiny_llama: Path) -> None:
    """--method gptq under a budget: the damages measured on the calibration windows, the
    codes chosen with GPTQ's feedback on each chosen type's grid, the budget held."""
    out = tmp_path / "gptq.gguf"
    result = llmq.quantize(tiny_llama, out, format="gguf", method="gptq", target_bits=5.2, num_samples=4, seq_len=32)  # fmt: skip
    record = result.mixed_precision
    assert record["sensitivity"] == "gradient" and record["written_bits"] <= 5.2
    tensors = _file_tensors(out)
    for name, sources in _sources(tiny_llama).items():
        if sources and sources[0] in record["linears"]:
            assert tensors[name].tensor_type.name == record["linears"][sources[0]]["stored_as"]


def test_a_mixtures_stacked_experts_take_one_type(tmp_path: Path, default_model: Path) -> None:
    from tests.conftest import TINY_EXPERTS

    experts = {**TINY_EXPERTS["qwen3_moe"], "moe_intermediate_size": 256, "norm_topk_prob": True}
    model = tiny(tmp_path / "moe", default_model, "qwen3_moe", head_dim=64, **experts)
    out = tmp_path / "moe.gguf"
    record = llmq.quantize(model, out, format="gguf", target_bits=5.5, **DATA_FREE).mixed_precision
    tensors = _file_tensors(out)
    for name, sources in _sources(model).items():
        if "_exps." in name:
            types = {record["linears"][source]["stored_as"] for source in sources}
            assert types == {tensors[name].tensor_type.name}
    assert record["written_bits"] <= 5.5


@pytest.mark.integration
def test_transformers_reads_the_mixed_file_back(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "mixed.gguf"
    llmq.quantize(tiny_llama, out, format="gguf", target_bits=5.0, num_samples=4, seq_len=32)
    code, report = verified(str(out), "--loader", "transformers")
    assert code == 0 and report["loaders"][0]["status"] == "ok"


@needs_llama_cpp
def test_llama_cpp_reads_the_mixed_file_back(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "mixed.gguf"
    llmq.quantize(tiny_llama, out, format="gguf", target_bits=5.0, **DATA_FREE)
    code, report = verified(str(out), "--loader", "llama.cpp")
    assert code == 0 and report["loaders"][0]["status"] == "ok"


@pytest.mark.integration
def test_the_report_and_json_show_the_choice(tmp_path: Path, tiny_llama: Path) -> None:
    from tests.cli.test_cli import run

    out = tmp_path / "m.gguf"
    args = ("quantize", str(tiny_llama), "--out", str(out), "--format", "gguf", "--target-bits", "5", "--imatrix", "none", "--sensitivity", "weight")  # fmt: skip
    shown = run(*args)
    assert shown.exit_code == 0, shown.output
    assert "mixed precision (weight sensitivity)" in shown.output and "q8_0" in shown.output
    as_json = json.loads(run(*args, "--overwrite", "--json").stdout)
    assert as_json["mixed_precision"]["written_bits"] <= 5


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (
            ["--target-bits", "4.4", "--sensitivity", "weight"],
            "the cheapest candidates store 4.5000 bits",
        ),
        (
            ["--target-bits", "5", "--sensitivity", "weight", "--candidates", "int4-g128,q8_0"],
            "'int4-g128' is not a GGUF type",
        ),
        (["--target-bits", "5", "--candidates", "q4_k"], "give at least two"),
        (
            ["--target-bits", "5", "--sensitivity", "output"],
            "sensitivity output: measured on calibration data",
        ),
        (
            ["--target-bits", "5", "--max-ppl-increase", "0.1", "--sensitivity", "weight"],
            "--max-ppl-increase: not an option of --format gguf",
        ),
        (["--candidates", "q4_k,q8_0"], "--candidates: chooses schemes under a budget"),
        (
            ["--target-bits", "5", "--sensitivity", "weight", "--candidates", "q4_k,q4_k"],
            "named twice",
        ),
        (
            ["--target-bits", "0", "--sensitivity", "weight"],
            "target_bits: Input should be greater than 0",
        ),
    ],
)
def test_bad_budgets_exit_2_and_write_nothing(
    tmp_path: Path, tiny_llama: Path, extra: list[str], fragment: str
) -> None:
    from tests.cli.test_cli import run

    out = tmp_path / "m.gguf"
    result = run("quantize", str(tiny_llama), "--out", str(out), "--format", "gguf", "--imatrix", "none", *extra)  # fmt: skip
    assert_bad_input(result, fragment)
    assert not out.exists()


def test_gptq_is_refused_with_a_table_type_candidate(tmp_path: Path, tiny_llama: Path) -> None:
    from tests.cli.test_cli import run

    out = tmp_path / "m.gguf"
    result = run("quantize", str(tiny_llama), "--out", str(out), "--format", "gguf", "--method", "gptq", "--target-bits", "5", "--candidates", "iq4_xs,q8_0", "--num-samples", "2", "--seq-len", "16")  # fmt: skip
    assert_bad_input(result, "GPTQ's error feedback runs on uniform grids, not on IQ4_XS")
    assert not out.exists()
