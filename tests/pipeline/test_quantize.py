"""The layer pipeline end to end on tiny models: format, reload, fallbacks, resume, failures."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import llmq
from llmq.errors import InputError, NumericalError
from llmq.io.atomic import lock_path, staging_path
from llmq.io.family import FAMILY_LAYOUT
from llmq.pipeline.linears import check_finite
from tests.conftest import make_tiny

# The layer pipeline (not model-free conversion) on two short calibration windows
FAST = {"num_samples": 2, "seq_len": 64, "model_free": False}


def logits_pair(out: Path) -> tuple[torch.Tensor, torch.Tensor]:  # weight-only schemes
    """Logits of OUT loaded by plain transformers (compressed-tensors decompresses it) and of
    llmq's own dequantized model, on the same tokens."""
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = llmq.load_dequantized(out)
    with torch.no_grad():
        return theirs(ids).logits, ours(ids).logits


def logits_with_activation_quantization(out: Path, ids: torch.Tensor) -> torch.Tensor:
    """llmq's dequantized model with the inputs of quantized linears (and the KV cache) fake-
    quantized as the checkpoint specifies, as `llmq eval` runs it, but on the whole model."""
    from contextlib import ExitStack

    from llmq.calib.stream import ATTENTION_IMPLEMENTATION, kv_hook, register_attention
    from llmq.io.checkpoint import open_checkpoint
    from llmq.pack.reader import QuantizedView
    from llmq.runtime.load import load_dequantized

    ckpt = open_checkpoint(out)
    view = QuantizedView(ckpt)
    model = load_dequantized(ckpt, quantize_inputs=True)
    register_attention()
    model.config._attn_implementation = ATTENTION_IMPLEMENTATION
    with ExitStack() as stack, torch.no_grad():
        for index in range(ckpt.num_layers):
            attention = ckpt.layout.layer_prefix(index) + ckpt.layout.attention
            kv = view.kv_quantizer(ckpt, attention)
            stack.enter_context(kv_hook(model.get_submodule(attention), kv))
        return model(ids).logits


# Tolerances, as a fraction of the largest logit. Exact for weight-only schemes and FP8. For
# W8A8, transformers + compressed-tensors 0.20 re-quantize the loaded int8 weights on every
# forward with their own scale (absmax / 127.5 of the dequantized weight), which moves codes
# onto another grid, and simulate activations with absmax / 127.5 where llmq follows the int8
# kernels (absmax / 127); llmq evaluates the stored codes as written. The stored weights
# themselves are bit-exact: test_compressed_tensors_decompressors_agree.
LOGIT_TOLERANCE = {
    "w4a16": 1e-5, "w8a16": 1e-5, "fp8": 1e-5, "w8a8": 0.1, "fp8-tensor": 1e-5, "fp8-block": 1e-5,
}  # fmt: skip
W8A8_MAX_RELATIVE_ERROR = 0.05  # ||reloaded - ours|| / ||ours||; measured 0.032 on the tiny model


@pytest.mark.parametrize("scheme", list(LOGIT_TOLERANCE))
def test_every_scheme_reloads_in_transformers(
    tmp_path: Path, tiny_llama: Path, scheme: str
) -> None:
    out = tmp_path / scheme
    result = llmq.quantize(tiny_llama, out, scheme=scheme, **FAST)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["ignore"] == ["lm_head"]
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        reloaded = theirs(ids).logits
    ours = logits_with_activation_quantization(out, ids)
    tol = LOGIT_TOLERANCE[scheme]
    torch.testing.assert_close(reloaded, ours, rtol=0, atol=tol * float(ours.abs().max()))
    if scheme == "w8a8":
        assert float((reloaded - ours).norm() / ours.norm()) < W8A8_MAX_RELATIVE_ERROR
    # the quantized model is close to, but not the same as, the float one
    assert all(0 < layer.output_rel_rmse < 1 for layer in result.layers)
    record = json.loads((out / "llmq.json").read_text())
    assert record["recipe"]["scheme"]["name"] == result.scheme
    assert record["calibration"]["seed"] == 0
    assert (out / "tokenizer.json").is_file()
    assert not staging_path(out).exists()


STATIC_AND_KV = {
    "fp8 static": {"scheme": "fp8", "activations": "static"},
    "fp8-tensor static percentile, kv fp8": {
        "scheme": "fp8-tensor", "activations": "static", "observer": "percentile", "kv_cache": "fp8",
    },
    "fp8 smooth auto, kv int8": {"scheme": "fp8", "smooth": "auto", "kv_cache": "int8"},
    "w8a8 smooth 0.5, static mse": {
        "scheme": "w8a8", "smooth": 0.5, "activations": "static", "observer": "mse",
    },
}  # fmt: skip


@pytest.mark.parametrize("options", list(STATIC_AND_KV))
def test_static_scales_and_kv_cache_reload_in_transformers(
    tmp_path: Path, tiny_llama: Path, options: str
) -> None:
    """Static input scales and KV cache scales land where compressed-tensors and vLLM read them,
    and transformers' reload (which simulates them) matches how llmq evaluates the checkpoint."""
    kwargs = STATIC_AND_KV[options]
    out = tmp_path / "out"
    llmq.quantize(tiny_llama, out, **kwargs, **FAST)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    tensors = load_file(out / "model-00002-of-00003.safetensors")
    prefix = "model.layers.0."
    static = kwargs.get("activations") == "static"
    for group in config["config_groups"].values():
        assert group["input_activations"]["dynamic"] is not static
    assert (f"{prefix}self_attn.q_proj.input_scale" in tensors) is static
    kv = kwargs.get("kv_cache")
    if kv is None:
        assert config.get("kv_cache_scheme") is None
    else:
        assert config["kv_cache_scheme"]["type"] == ("float" if kv == "fp8" else "int")
        assert tensors[f"{prefix}self_attn.k_scale"].shape == (1,)
        assert float(tensors[f"{prefix}self_attn.v_scale"]) > 0
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        reloaded = theirs(ids).logits
    ours = logits_with_activation_quantization(out, ids)
    tol = LOGIT_TOLERANCE[kwargs["scheme"]]
    torch.testing.assert_close(reloaded, ours, rtol=0, atol=tol * float(ours.abs().max()))


@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
def test_static_absmax_scale_is_the_calibration_range(
    tmp_path: Path, tiny_llama: Path, scheme: str
) -> None:
    """Layer 0 reads the embeddings, which quantization does not change: its q_proj input scale
    is exactly max |input_layernorm(embeddings)| over the calibration windows / qmax."""
    from llmq.calib.collect import run_observed
    from llmq.calib.data import calibration_windows
    from llmq.calib.stream import LayerStream
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.io.checkpoint import open_checkpoint
    from llmq.texts import DEFAULT_CALIBRATION_TEXT

    out = tmp_path / "out"
    llmq.quantize(tiny_llama, out, scheme=scheme, activations="static", **FAST)
    windows = calibration_windows(
        load_tokenizer(tiny_llama), DEFAULT_CALIBRATION_TEXT, num_samples=2, seq_len=64, seed=0
    )
    stream = LayerStream(open_checkpoint(tiny_llama), device="cpu")
    layer = stream.load_layer(0)
    _, observed = run_observed(
        stream, layer, ["self_attn.q_proj"], stream.embed(windows.input_ids), hessian=False
    )
    limit = 448.0 if scheme == "fp8" else 127.0
    expected = float(observed["self_attn.q_proj"].absmax.max()) / limit
    stored = load_file(out / "model-00002-of-00003.safetensors")
    assert float(stored["model.layers.0.self_attn.q_proj.input_scale"]) == pytest.approx(
        expected, rel=1e-6
    )
    # q/k/v read the same input, so they share it (vLLM fuses them into one GEMM)
    assert float(stored["model.layers.0.self_attn.k_proj.input_scale"]) == float(
        stored["model.layers.0.self_attn.q_proj.input_scale"]
    )


@pytest.mark.integration
def test_eval_applies_the_stored_kv_scales(tmp_path: Path, default_model: Path) -> None:
    """`llmq eval` quantizes the cache with the stored k_scale / v_scale: scales shrunk 1000x
    saturate the keys and values and the perplexity moves far; the report says KV fp8. On the
    real model (a random tiny one hardly uses its attention)."""
    out = tmp_path / "kv"
    llmq.quantize(default_model, out, scheme="fp8", kv_cache="fp8", clip="none", **FAST)
    shrunk = tmp_path / "kv-shrunk"
    shutil.copytree(out, shrunk)
    for shard in shrunk.glob("model-*.safetensors"):
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith(("k_scale", "v_scale"))]:
            tensors[name] = tensors[name] / 1000
        save_file(tensors, shard, metadata={"format": "pt"})
    plain = tmp_path / "no-kv"
    llmq.quantize(default_model, plain, scheme="fp8", clip="none", **FAST)
    options = {"text": "news", "seq_len": 64, "max_windows": 2, "use_cache": False}
    with_kv = llmq.evaluate(out, **options).model
    assert with_kv.quantized.endswith("KV fp8 tensor static")
    without = llmq.evaluate(plain, **options).model.perplexity
    saturated = llmq.evaluate(shrunk, **options).model.perplexity
    assert with_kv.perplexity != without
    assert abs(saturated - with_kv.perplexity) > 10 * abs(with_kv.perplexity - without)


@pytest.mark.parametrize(
    ("scheme", "method"),
    [
        *((s, "rtn") for s in ("w4a16", "w4a16-asym", "w8a16", "w8a8", "fp8", "fp8-tensor")),
        ("fp8-block", "rtn"),
        ("fp8-block", "gptq"),  # GPTQ keeps one scale per 128 x 128 block
    ],
)
def test_compressed_tensors_decompressors_agree(
    tmp_path: Path, tiny_llama: Path, scheme: str, method: str
) -> None:
    """compressed-tensors' own decompressor for each format reads llmq's tensors bit-exactly
    (asymmetric included: transformers cannot reload packed zero points with
    compressed-tensors 0.20, which initializes them unpacked; vLLM reads them packed)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out = tmp_path / scheme
    llmq.quantize(tiny_llama, out, scheme=scheme, method=method, **FAST)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    ours = llmq.load_dequantized(out).state_dict()
    tensors = load_file(out / "model-00002-of-00003.safetensors")
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    checked = 0
    for group in config["config_groups"].values():
        scheme_obj = QuantizationScheme.model_validate(group)
        patterns = [re.compile(target.removeprefix("re:")) for target in group["targets"]]
        for name in {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}:
            if any(p.match(name) for p in patterns):
                local = {
                    k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(name + ".")
                }
                theirs = compressor.decompress(local, scheme_obj)["weight"]
                assert torch.equal(theirs.float(), ours[f"{name}.weight"]), name
                checked += 1
    assert checked == 7


# GPT-OSS writes its experts in its own MXFP4 format only (tests/pipeline/test_gpt_oss.py);
# Kimi K2 is built as DeepSeek-V3 (tests/pipeline/test_fp8_release.py)
@pytest.mark.parametrize("family", sorted(set(FAMILY_LAYOUT) - {"llama", "gpt_oss", "kimi_k2"}))
def test_other_families_quantize_and_reload(
    tmp_path: Path, default_model: Path, family: str
) -> None:
    model = make_tiny(tmp_path / family, default_model, model_type=family, layers=1)
    out = tmp_path / f"{family}-w4a16"
    llmq.quantize(model, out, scheme="w4a16", **FAST)
    theirs, ours = logits_pair(out)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_group_size_fallback_is_listed_and_exact(tmp_path: Path, tiny_llama: Path) -> None:
    result = llmq.quantize(tiny_llama, tmp_path / "out", scheme="w4a16", **FAST)
    adjusted = {a["name"].split(".", 3)[-1] for a in result.group_size_adjustments}
    assert adjusted == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    }  # fmt: skip  (in_features 192 -> group 64; down_proj reads 512, divisible by 128)
    groups = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    sizes = sorted(g["weights"]["group_size"] for g in groups["config_groups"].values())
    assert sizes == [64, 128]
    tensors = load_file(tmp_path / "out" / "model-00002-of-00003.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (192, 3)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (192, 4)


def test_strict_group_size_refuses_before_work(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(InputError, match="does not divide in_features 192") as info:
        llmq.quantize(tiny_llama, tmp_path / "out", scheme="w4a16", strict_group_size=True, **FAST)
    assert "64" in (info.value.hint or "")
    assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()


def test_bf16_shards_keep_bf16_scales(tmp_path: Path, tiny_llama_sharded: Path) -> None:
    out = tmp_path / "out"
    llmq.quantize(tiny_llama_sharded, out, scheme="w4a16", **FAST)
    tensors = load_file(out / "model-00002-of-00003.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.bfloat16
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    theirs, ours = logits_pair(out)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


class InterruptAfter:
    """A progress sink that raises KeyboardInterrupt (as Ctrl-C would) after N finished layers."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    @contextmanager
    def stage(
        self, description: str, total: int | None = None, *, transient: bool = False
    ) -> Iterator:
        def advance(steps: int = 1) -> None:
            if description in ("quantizing layers", "pruning layers") and steps:
                self.layers -= steps
                if self.layers <= 0:
                    raise KeyboardInterrupt

        yield advance


def checkpoint_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "llmq.json"}


W8A8_RTN = {"scheme": "w8a8"}  # two passes a layer
W4A16_GPTQ = {"scheme": "w4a16", "method": "gptq", "group_size": 32}  # group by group
SPARSEGPT_ALONE = {"scheme": "dense", "method": "sparsegpt", "sparsity": 0.5}  # `llmq prune`


@pytest.mark.parametrize(
    ("every_s", "resumed", "job"),
    [(0, 2, W8A8_RTN), (3600, 0, W8A8_RTN), (0, 2, W4A16_GPTQ), (0, 2, SPARSEGPT_ALONE)],
    ids=["every-layer", "none-saved", "gptq-staged", "prune-sparsegpt"],
)
def test_resume_after_interrupt_gives_identical_checkpoint(
    tmp_path: Path, default_model: Path, every_s: float, resumed: int, job: dict
) -> None:
    """Interrupted after two layers: with a resume point after every layer the rerun continues
    after them; with none saved yet (the interval has not passed) it starts over."""
    model = make_tiny(tmp_path / "model", default_model, layers=4)
    reference = tmp_path / "reference"
    llmq.quantize(model, reference, **job, **FAST)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        llmq.quantize(model, out, progress=InterruptAfter(2), resume_every_s=every_s, **job, **FAST)
    assert not out.exists()
    assert (staging_path(out) / "model-00003-of-00005.safetensors").exists()  # layer 1's shard
    state = staging_path(out) / "llmq-state.json"
    assert len(json.loads(state.read_text())["layers"] if state.exists() else []) == resumed
    if resumed:  # a saved state is only continued with the same recipe
        with pytest.raises(InputError, match="different model or recipe"):
            llmq.quantize(model, out, scheme="w4a16", resume=True, **FAST)
    result = llmq.quantize(model, out, resume=True, **job, **FAST)
    assert result.resumed_layers == resumed
    assert checkpoint_bytes(out) == checkpoint_bytes(reference)


def test_nan_stops_the_run_naming_the_layer(tmp_path: Path, tiny_llama: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NumericalError, match=r"model\.layers\.1\.mlp\.up_proj"):
        llmq.quantize(model, tmp_path / "out", scheme="w8a16", **FAST)
    assert not (tmp_path / "out").exists()


def test_an_inf_in_a_norm_stops_the_run_at_that_layers_output(
    tmp_path: Path, tiny_llama: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.post_attention_layernorm.weight"][-1] = float("inf")
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NumericalError, match="the output of layer 1"):
        llmq.quantize(model, tmp_path / "out", scheme="w8a16", **FAST)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, -1])
def test_check_finite_finds_one_bad_value_anywhere(bad: float, where: int) -> None:
    values = torch.randn(4, 64, 32)
    values.view(-1)[where] = bad
    with pytest.raises(NumericalError, match="NaN or Inf in the probe"):
        check_finite(values, "the probe")
    check_finite(torch.randn(4, 64, 32), "the probe")


def test_existing_output_needs_overwrite(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(InputError, match="already exists"):
        llmq.quantize(tiny_llama, out, scheme="w8a16", **FAST)
    assert (out / "keep.txt").read_text() == "user data"
    with pytest.raises(InputError, match="not written by llmq"):  # --overwrite replaces ours only
        llmq.quantize(tiny_llama, out, scheme="w8a16", overwrite=True, **FAST)
    assert (out / "keep.txt").read_text() == "user data"
    (out / "keep.txt").unlink()
    llmq.quantize(tiny_llama, out, scheme="w8a16", overwrite=True, **FAST)  # empty: replaced
    (out / "keep.txt").write_text("added later")
    llmq.quantize(tiny_llama, out, scheme="w8a16", overwrite=True, **FAST)  # llmq's: replaced
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_quantizing_a_quantized_checkpoint_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "out"
    llmq.quantize(tiny_llama, out, scheme="w8a16", **FAST)
    with pytest.raises(InputError, match="already quantized"):
        llmq.quantize(out, tmp_path / "again", scheme="w8a16", **FAST)


@pytest.mark.process
def test_sigkill_mid_run_then_resume_is_identical(tmp_path: Path, default_model: Path) -> None:
    """A real kill (SIGKILL: no cleanup runs) half-way, then --resume, equals an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    model = make_tiny(tmp_path / "model", default_model, layers=8)
    options = ["--scheme", "w4a16", "--num-samples", "16", "--seq-len", "256"]
    reference = tmp_path / "reference"
    llmq.quantize(model, reference, scheme="w4a16", num_samples=16, seq_len=256)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "llmq.cli.main",
        "quantize",
        str(model),
        "--out",
        str(out),
        "--resume-every",
        "0",
        *options,
    ]
    state = staging_path(out) / "llmq-state.json"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if state.is_file() and len(json.loads(state.read_text())["layers"]) >= 3:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert not out.exists()
    assert lock_path(out).exists()  # no cleanup ran; the kernel released the lock itself
    resumed = subprocess.run(
        [*cmd, "--resume", "--json"], capture_output=True, text=True, check=True
    )
    assert json.loads(resumed.stdout)["resumed_layers"] >= 3
    assert checkpoint_bytes(out) == checkpoint_bytes(reference)


def test_skip_layer_check_writes_the_same_weights(tmp_path: Path, tiny_llama: Path) -> None:
    """RTN reads no data: skipping the per-layer check changes the report, not the checkpoint."""
    checked = llmq.quantize(tiny_llama, tmp_path / "checked", scheme="w4a16", **FAST)
    skipped = llmq.quantize(tiny_llama, tmp_path / "skipped", scheme="w4a16", skip_layer_check=True, model_free=False)  # fmt: skip
    assert all(layer.output_rel_rmse is None for layer in skipped.layers)
    assert all(layer.output_rel_rmse is not None for layer in checked.layers)
    shards = sorted(p.name for p in (tmp_path / "checked").glob("*.safetensors"))
    for shard in shards:
        assert (tmp_path / "checked" / shard).read_bytes() == (
            tmp_path / "skipped" / shard
        ).read_bytes()
    with pytest.raises(InputError, match="needs calibration data"):
        llmq.make_recipe(method="gptq", skip_layer_check=True)


@pytest.mark.parametrize(
    "scheme, method, clip",
    [
        ("w4a16", "gptq", "output"),  # calibrated int4: the output-error clip search
        ("w4a16-asym", "awq", "output"),
        ("w4a16", "awq+gptq", "output"),
        ("w4a16", "rtn", "none"),  # data-free by default
        ("w8a8", "gptq", "none"),  # int8 keeps its range
        ("fp8", "rtn", "mse"),  # the preset's own
    ],
)
def test_default_clip_follows_scheme_and_method(scheme: str, method: str, clip: str) -> None:
    assert llmq.make_recipe(scheme=scheme, method=method).clip == clip
    assert llmq.make_recipe(scheme=scheme, method=method, clip="none").clip == "none"


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym", "w8a16", "w8a8", "fp8", "fp8-block"])
def test_the_plan_knows_the_output_size(tmp_path: Path, tiny_llama: Path, scheme: str) -> None:
    """The space check's estimate covers the checkpoint written, without asking for much more."""
    from llmq.io.checkpoint import open_checkpoint
    from llmq.pipeline.plan import output_bytes, plan_quantization

    recipe = llmq.make_recipe(scheme=scheme, skip_layer_check=True)
    (tiny_llama / "pytorch_model.bin").write_bytes(b"\0" * 2**20)  # a second copy, never copied
    try:
        ckpt = open_checkpoint(tiny_llama)
        estimate = output_bytes(ckpt.path, ckpt.tensors, plan_quantization(ckpt, recipe))  # fmt: skip
    finally:
        (tiny_llama / "pytorch_model.bin").unlink()
    out = tmp_path / "out"
    llmq.quantize(tiny_llama, out, recipe=recipe)
    written = sum(p.stat().st_size for p in out.iterdir() if p.name != "llmq.json")
    assert written <= estimate <= 1.05 * written


def test_resuming_with_another_number_of_processes_is_refused(tmp_path: Path) -> None:
    """Each torchrun process's resume point holds its own windows: one process cannot go on
    from two processes' points, and the error says why."""
    from llmq.io.atomic import write_json
    from llmq.pipeline.state import STATE_FILE, load_state

    fingerprint = {"recipe": {"scheme": "w4a16"}, "source": {"path": "m"}}
    write_json(
        tmp_path / STATE_FILE, {"fingerprint": {**fingerprint, "processes": 2}, "layers": []}
    )
    with pytest.raises(InputError, match="or number of torchrun processes"):
        load_state(tmp_path, fingerprint, 60.0)
    assert load_state(tmp_path, {**fingerprint, "processes": 2}, 60.0) is not None
