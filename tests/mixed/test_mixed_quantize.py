"""`quantize --target-bits` / `--max-size` end to end on a tiny Llama: the budget holds for
the bits counted from the written files, fused linears share a scheme, the checkpoint loads in
transformers with llmq's own logits, the record says what was chosen; bad budgets are one
line, exit 2, nothing written."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.config import fit_group_size
from llmq.config.mixed import candidate_args
from llmq.io.checkpoint import open_checkpoint
from llmq.mixed import choose as choose_module
from llmq.mixed.sensitivity import resolved_sensitivity
from llmq.pack.sizes import stored_bytes
from tests.conftest import assert_bad_input, make_tiny

CALIBRATION = {"num_samples": 4, "seq_len": 64}


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """Two layers, hidden 192 (group 128 does not divide it), stored in bfloat16."""
    return make_tiny(tmp_path_factory.mktemp("mixed") / "llama", default_model, dtype=torch.bfloat16)  # fmt: skip


def decoder_linears(model: Path) -> dict[str, int]:
    """Each decoder linear of the source checkpoint -> its weights."""
    ckpt = open_checkpoint(model)
    names = [n for i in range(ckpt.num_layers) for n in ckpt.layout.linear_names(i)]
    return {n: math.prod(ckpt.tensors[f"{n}.weight"].shape) for n in names}


def written_tensor_bytes(folder: Path, prefixes: tuple[str, ...] = ("",)) -> int:
    """Bytes of the tensors in `folder` whose names start with one of `prefixes`, read back."""
    total = 0
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                if key.startswith(prefixes):
                    tensor = f.get_tensor(key)
                    total += tensor.numel() * tensor.element_size()
    return total


def bits_per_weight(folder: Path, model: Path) -> float:
    linears = decoder_linears(model)
    stored = written_tensor_bytes(folder, tuple(f"{n}." for n in linears))
    return 8 * stored / sum(linears.values())


@pytest.mark.parametrize("target", [4.3, 5.0, 7.0])
def test_written_bits_stay_within_the_target_and_match_the_record(
    tmp_path: Path, tiny_bf16: Path, target: float
) -> None:
    out = tmp_path / "mixed"
    result = llmq.quantize(tiny_bf16, out, method="gptq", target_bits=target, **CALIBRATION)
    measured = bits_per_weight(out, tiny_bf16)
    assert measured <= target
    record = json.loads((out / "llmq.json").read_text())["mixed_precision"]
    assert record["written_bits"] == pytest.approx(measured, rel=1e-12)
    assert record["predicted_bits"] == pytest.approx(measured, rel=1e-12)
    assert result.mixed_precision["written_bits"] == record["written_bits"]
    assert set(record["linears"]) == set(decoder_linears(tiny_bf16))
    # a budget with room to spare spends it: within the cheapest step of the target
    assert measured > target - 0.5


def test_fused_linears_share_a_scheme_and_transformers_reads_llmqs_weights(
    tmp_path: Path, tiny_bf16: Path
) -> None:
    """q/k/v and gate/up (vLLM's fused qkv_proj and gate_up_proj) take one candidate each; the
    mix is written as config groups transformers loads, with the logits llmq recorded."""
    out = tmp_path / "mixed"
    llmq.quantize(tiny_bf16, out, method="gptq", target_bits=5.0, **CALIBRATION)
    chosen = json.loads((out / "llmq.json").read_text())["mixed_precision"]["linears"]
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            block = "self_attn" if fused[0] == "q_proj" else "mlp"
            assert len({chosen[f"{prefix}{block}.{n}"]["candidate"] for n in fused}) == 1
    assert len({entry["candidate"] for entry in chosen.values()}) > 1  # a mix, not one scheme
    verified = llmq.verify(out, loaders=["transformers", "llmq"])
    assert verified.passed, [row.detail for row in verified.loaders]


def test_dense_choices_join_ignore_and_max_size_bounds_the_files(
    tmp_path: Path, tiny_bf16: Path
) -> None:
    """--max-size counts every tensor written; a linear chosen dense is in the ignore list and
    stored as it was."""
    linears = 2 * sum(decoder_linears(tiny_bf16).values())  # bfloat16, as stored
    size = written_tensor_bytes(tiny_bf16) - linears // 2  # room for some dense linears
    out = tmp_path / "mixed"
    llmq.quantize(tiny_bf16, out, method="rtn", max_size=str(size), candidates=("int4-g32", "dense"), **CALIBRATION)  # fmt: skip
    assert written_tensor_bytes(out) <= size
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    chosen = json.loads((out / "llmq.json").read_text())["mixed_precision"]["linears"]
    dense = sorted(name for name, entry in chosen.items() if entry["candidate"] == "dense")
    assert dense and sorted(set(config["ignore"]) - {"lm_head"}) == dense


def test_the_choice_is_the_least_recorded_damage_within_the_budget(
    tmp_path: Path, tiny_bf16: Path
) -> None:
    """Brute force over every assignment of the two candidates to the 8 units (q/k/v, o,
    gate/up, down of two layers), from the damages llmq.json records and the bytes each
    candidate stores: the solver's choice is the least total damage that fits."""
    out = tmp_path / "mixed"
    candidates = ("int4-g32", "int8")
    llmq.quantize(tiny_bf16, out, method="rtn", target_bits=6.0, candidates=candidates, **CALIBRATION)  # fmt: skip
    chosen = json.loads((out / "llmq.json").read_text())["mixed_precision"]["linears"]
    ckpt = open_checkpoint(tiny_bf16)
    units = [
        [f"{ckpt.layout.layer_prefix(i)}{name}" for name in group]
        for i in range(ckpt.num_layers)
        for group in ckpt.layout.sequential
    ]
    weights = sum(decoder_linears(tiny_bf16).values())

    def bits(name: str, candidate: str) -> int:
        rows, columns = ckpt.tensors[f"{name}.weight"].shape
        args = fit_group_size(candidate_args(candidate), columns)
        return 8 * stored_bytes(args, rows, columns, torch.bfloat16)

    best = None
    for options in itertools.product(candidates, repeat=len(units)):
        cost = sum(bits(n, c) for unit, c in zip(units, options, strict=True) for n in unit)
        damage = sum(
            chosen[n]["damages"][c] for unit, c in zip(units, options, strict=True) for n in unit
        )
        if cost <= 6.0 * weights and (best is None or damage < best[0]):
            best = (damage, options)
    assert best is not None
    assert [chosen[unit[0]]["candidate"] for unit in units] == list(best[1])
    assert len(set(best[1])) == 2  # the budget forces a mix


@pytest.mark.parametrize("sensitivity", ["residual", "gradient", "fisher", "weight"])
def test_other_sensitivities_choose_within_the_budget(
    tmp_path: Path, tiny_bf16: Path, sensitivity: str
) -> None:
    out = tmp_path / sensitivity
    llmq.quantize(tiny_bf16, out, method="rtn", target_bits=5.0, sensitivity=sensitivity, **CALIBRATION)  # fmt: skip
    assert bits_per_weight(out, tiny_bf16) <= 5.0
    record = json.loads((out / "llmq.json").read_text())["mixed_precision"]
    assert record["sensitivity"] == sensitivity
    dense = [e["damage"] for e in record["linears"].values() if e["candidate"] == "dense"]
    assert all(d == 0.0 for d in dense)


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--target-bits", "3"], "--target-bits 3: the cheapest candidates store"),
        (["--max-size", "10KiB"], "--max-size 10240: the cheapest candidates write"),
        (["--max-size", "lots"], "expected a size"),
        (["--target-bits", "4.5", "--max-size", "1GiB"], "give one budget"),
        (["--candidates", "int4-g64"], "--candidates: chooses schemes under a budget"),
        (["--target-bits", "5", "--candidates", "int3,dense"], "'int3' is not a candidate"),
        (
            ["--target-bits", "5", "--candidates", "int4-g48,dense"],
            "'int4-g48' is not a candidate",
        ),
        (["--target-bits", "5", "--candidates", "int8"], "at least two"),
        (["--target-bits", "5", "--scheme", "w8a8"], "weight-only integer"),
        (["--target-bits", "5", "--group-size", "64"], "each candidate names its own"),
        (["--target-bits", "5", "--method", "wanda", "--sparsity", "0.5"], "prunes"),
        (["--target-bits", "5", "--fallback", "auto"], "--fallback"),
        (["--target-bits", "5", "--sensitivity", "guess"], "sensitivity"),
        (["--max-size", "1GiB", "--max-ppl-increase", "1%"], "--max-size is a limit"),
        (["--max-ppl-increase", "1%"], "chooses schemes under a budget"),
        (
            ["--target-bits", "5", "--max-ppl-increase", "1%", "--eval-text", "/nonexistent.txt"],
            "no such file",
        ),
        (["--target-bits", "5", "--fisher-windows", "0"], "--fisher-windows"),
        (["--target-bits", "5", "--max-ppl-increase", "1%", "--step-bits", "0"], "--step-bits"),
        (["--max-size", "0"], "--max-size"),
        (["--target-bits", "5", "--skip-layer-check"], "measured on calibration data"),
    ],
)
def test_bad_budgets_are_one_line_exit_2_and_write_nothing(
    tmp_path: Path, tiny_bf16: Path, flags: list[str], fragment: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(tiny_bf16), "--out", str(out), *flags])
    assert_bad_input(result, fragment)
    assert not out.exists()


def test_a_perplexity_gate_spends_more_bits_until_it_passes(
    tmp_path: Path, tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gate of no increase at all passes only when every linear is dense again (the same
    bfloat16 weights): the budget rises by its step, attempt after attempt, up to that. The
    damages are measured by the first attempt only, and are those an ungated run measures."""
    measuring = []
    real = choose_module.measure_damages
    monkeypatch.setattr(choose_module, "measure_damages", lambda *a, **k: measuring.append(1) or real(*a, **k))  # fmt: skip
    out = tmp_path / "gated"
    result = llmq.quantize(
        tiny_bf16, out, method="rtn", target_bits=4.6, step_bits=6, max_ppl_increase=0.0,
        eval_windows=2, candidates=("int4-g32", "int8", "dense"), **CALIBRATION,
    )  # fmt: skip
    attempts = result.mixed_precision["gate"]["attempts"]
    assert [a["target_bits"] for a in attempts] == pytest.approx([4.6, 10.6, 16.0])
    recorded = json.loads((out / "llmq.json").read_text())["mixed_precision"]["gate"]
    assert recorded["attempts"] == attempts
    assert all(a["written_bits"] <= a["target_bits"] for a in attempts)
    assert attempts[0]["ppl_increase"] > 0 and attempts[-1]["ppl_increase"] <= 0
    assert bits_per_weight(out, tiny_bf16) == pytest.approx(16.0, rel=1e-3)
    assert len(measuring) == 1
    ungated = llmq.quantize(
        tiny_bf16, tmp_path / "ungated", method="rtn", target_bits=16.0,
        candidates=("int4-g32", "int8", "dense"), **CALIBRATION,
    )  # fmt: skip
    damages = {n: e["damages"] for n, e in result.mixed_precision["linears"].items()}
    assert damages == {n: e["damages"] for n, e in ungated.mixed_precision["linears"].items()}


def test_a_gate_no_budget_can_pass_exits_1_and_keeps_the_last_attempt(
    tmp_path: Path, tiny_bf16: Path
) -> None:
    out = tmp_path / "gated"
    flags = ["--method", "rtn", "--target-bits", "7", "--candidates", "int4-g32,int8",
             "--max-ppl-increase", "0", "--eval-windows", "2", "--num-samples", "4", "--seq-len", "64"]  # fmt: skip
    result = CliRunner().invoke(app, ["quantize", str(tiny_bf16), "--out", str(out), *flags])
    assert result.exit_code == 1, result.output
    assert "even at" in result.output and "Traceback" not in result.output
    assert bits_per_weight(out, tiny_bf16) <= 8.1


def test_a_statistics_files_hessians_are_what_the_damages_read(tmp_path: Path, tiny_bf16: Path) -> None:  # fmt: skip
    """Statistics from `llmq calibrate --hessian` on news give the damages a measuring pass on
    news gives, not those of the run's own calibration text: the file is what is read."""
    stats = tmp_path / "stats.safetensors"
    llmq.calibrate(tiny_bf16, stats, hessian=True, calib_text="news", **CALIBRATION)
    runs = {"file": {"calib_stats": stats}, "news": {"calib_text": "news"}, "default": {}}
    runs = {name: {**extra, "sensitivity": "output"} for name, extra in runs.items()}
    damages = {}
    for name, extra in runs.items():
        llmq.quantize(tiny_bf16, tmp_path / name, method="rtn", target_bits=5.0, **CALIBRATION, **extra)  # fmt: skip
        linears = json.loads((tmp_path / name / "llmq.json").read_text())["mixed_precision"]["linears"]  # fmt: skip
        damages[name] = [d for entry in linears.values() for d in entry["damages"].values()]
    assert damages["file"] == pytest.approx(damages["news"], rel=1e-5)
    assert damages["file"] != pytest.approx(damages["default"], rel=1e-2)


def test_auto_sensitivity_is_gradient_where_the_model_fits_and_dense(
    tmp_path: Path, tiny_bf16: Path, default_model: Path
) -> None:
    out = tmp_path / "auto"
    llmq.quantize(tiny_bf16, out, method="rtn", target_bits=5.0, **CALIBRATION)
    assert (
        json.loads((out / "llmq.json").read_text())["mixed_precision"]["sensitivity"] == "gradient"
    )
    moe = open_checkpoint(make_tiny(tmp_path / "moe", default_model, model_type="qwen3_moe"))
    assert resolved_sensitivity(moe, "auto") == "output"
    assert resolved_sensitivity(open_checkpoint(tiny_bf16), "weight") == "weight"


def test_fp8_candidates_mix_with_integers_in_a_checkpoint_transformers_reads(
    tmp_path: Path, tiny_bf16: Path
) -> None:
    """int4 and FP8 weights: groups in pack-quantized and float-quantized, the checkpoint's
    format `mixed-precision`; transformers and llmq read exactly llmq's weights."""
    out = tmp_path / "mixed"
    llmq.quantize(tiny_bf16, out, method="gptq", target_bits=6.5, candidates=("int4-g64", "fp8"), **CALIBRATION)  # fmt: skip
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    assert {g["format"] for g in config["config_groups"].values()} == {"pack-quantized", "float-quantized"}  # fmt: skip
    assert bits_per_weight(out, tiny_bf16) <= 6.5
    verified = llmq.verify(out, loaders=["transformers", "llmq"])
    assert verified.passed, [row.detail for row in verified.loaders]


def test_fp4_candidates_write_each_group_in_its_own_format(tmp_path: Path, tiny_bf16: Path) -> None:  # fmt: skip
    """NVFP4, MXFP4 and FP8 weights beside int4: each group in its own compressed-tensors
    format, every linear decompressed by compressed-tensors' compressor of its group's format
    to llmq's weights (in the dtype it decompresses to: bfloat16 for these scales); llmq's
    loader matches the reference; transformers reads no such mix, and llmq.json says so."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from llmq.pack.format import decompress

    candidates = ("int4-g64", "nvfp4a16", "mxfp4a16", "fp8")
    out = tmp_path / "mixed"
    llmq.quantize(tiny_bf16, out, method="gptq", target_bits=5.5, candidates=candidates, **CALIBRATION)  # fmt: skip
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    record = json.loads((out / "llmq.json").read_text())
    used = {entry["candidate"] for entry in record["mixed_precision"]["linears"].values()}
    assert len(used) > 2 and used & {"nvfp4a16", "mxfp4a16"}
    assert config["format"] == "mixed-precision"
    assert bits_per_weight(out, tiny_bf16) <= 5.5
    files = {k: v for shard in out.glob("*.safetensors") for k, v in load_file(shard).items()}
    for group in config["config_groups"].values():
        scheme = QuantizationScheme(**group)
        compressor = BaseCompressor.get_value_from_registry(group["format"])
        for module in group["targets"]:
            names = [n for n in decoder_linears(tiny_bf16) if n == module or (module.startswith("re:") and re.match(module[3:], n))]  # fmt: skip
            for name in names:
                state = {
                    k[len(name) + 1 :]: v for k, v in files.items() if k.startswith(f"{name}.")
                }
                theirs = compressor.decompress(dict(state), scheme)["weight"]
                chosen = record["mixed_precision"]["linears"][name]["candidate"]
                ours = decompress(state, fit_group_size(candidate_args(chosen), 192))
                assert torch.equal(theirs, ours.to(theirs.dtype)), name  # in the dtype it gives
    assert record["loaders"]["transformers"]["reads"] is False
    verified = llmq.verify(out, loaders=["transformers", "llmq"])
    transformers, ours = verified.loaders
    assert transformers.status == "does not load" and ours.status == "ok"


def test_a_required_loader_that_cannot_read_the_mix_is_refused(tmp_path: Path, tiny_bf16: Path) -> None:  # fmt: skip
    out = tmp_path / "mixed"
    result = CliRunner().invoke(app, ["quantize", str(tiny_bf16), "--out", str(out), "--target-bits", "5", "--candidates", "int4-g64,nvfp4a16", "--require-loader", "transformers", "--num-samples", "2", "--seq-len", "16"])  # fmt: skip
    assert_bad_input(result, "--require-loader transformers: a mix of --candidates int4-g64, nvfp4a16 may hold FP4 or MX groups")  # fmt: skip
    assert not out.exists()
