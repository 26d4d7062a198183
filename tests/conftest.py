"""Shared fixtures: tiny random models of each supported family (mechanics) and the real
default model (accuracy). Tiny models reuse the default model's tokenizer so that calibration
runs on real text."""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter. It is chosen when a
# kernel is decorated, so before any test imports llmq.kernels.w4a16 / w8a8.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The config fields of tiny mixture-of-experts models, by model_type.
_TINY_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}
TINY_EXPERTS = {
    "qwen3_moe": {**_TINY_EXPERTS, "moe_intermediate_size": 128},
    "olmoe": {**_TINY_EXPERTS, "intermediate_size": 128},
    "qwen2_moe": {
        **_TINY_EXPERTS,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128},
    # latent attention (low-rank q and kv), a shared expert, one dense layer before the experts
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "head_dim": 16,  # transformers' rotary reads head_dim: the rope part
        "num_key_value_heads": 3,  # as many as query heads, as DeepSeek-V3's config says
    },
}

# What `scripts/test.sh --fast` leaves out is found by marker, so the markers must be right: a
# test that starts a Python process without `process`, or launches a Triton kernel in the
# interpreter without `interpreter`, fails saying which marker it needs (docs/tests.md).
_running: list[pytest.Item] = []  # the test whose setup, call or teardown is under way


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def _require_marker(marker: str, doing: str) -> None:
    if _running and _running[-1].get_closest_marker(marker) is None:
        pytest.fail(
            f"{_running[-1].nodeid} {doing}: mark it @pytest.mark.{marker} "
            "(scripts/test.sh --fast leaves such tests out)",
            pytrace=False,
        )


def _starts_python(args: Any, executable: Any) -> bool:
    program = executable or (args.split()[0] if isinstance(args, str) else args)
    if not isinstance(program, (str, bytes, os.PathLike)):
        program = next(iter(program), "")
    name = os.path.basename(os.fsdecode(program))
    return name.startswith("python") or name == os.path.basename(sys.executable)


def pytest_configure(config: pytest.Config) -> None:
    # Each pytest-xdist worker takes its share of the cores: torch's default, a thread per core in
    # every worker, oversubscribes them and spins (measured: half the CPU time for nothing).
    if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    @functools.wraps(popen_init)
    def checked_popen_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _starts_python(args, kwargs.get("executable") or (rest[1] if len(rest) > 1 else None)):
            _require_marker("process", "starts a Python process")
        popen_init(self, args, *rest, **kwargs)

    @functools.wraps(process_start)
    def checked_process_start(self: multiprocessing.process.BaseProcess) -> None:
        _require_marker("process", "starts a multiprocessing process")
        process_start(self)

    subprocess.Popen.__init__ = checked_popen_init  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = checked_process_start  # type: ignore[method-assign]
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    interpreted_run = InterpretedFunction.run

    @functools.wraps(interpreted_run)
    def checked_run(self: InterpretedFunction, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("warmup"):
            _require_marker("interpreter", f"launches Triton kernel {self.__name__}")
        return interpreted_run(self, *args, **kwargs)

    InterpretedFunction.run = checked_run  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def default_model() -> Path:
    from llmq.models import builtin_model_path

    return builtin_model_path("smollm2-135m")


def make_tiny(
    dest: Path,
    tokenizer_from: Path,
    *,
    model_type: str = "llama",
    hidden: int = 192,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    shards: str | None = None,
    kv_heads: int = 1,
    heads: int = 3,
    tied: bool = True,
    **config_fields: object,
) -> Path:
    """A small random decoder of `model_type`, saved as a Hugging Face folder.

    hidden 192 is not divisible by 128 (like SmolLM2's 576), so the group-size fallback runs.
    Mixtures of experts get 4 experts of 128, 2 per token (`TINY_EXPERTS`), and a router with
    a realistic spread; `config_fields` set anything else."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        **{"vocab_size": 49152, "num_key_value_heads": kv_heads, "head_dim": 64, "intermediate_size": 512, **TINY_EXPERTS.get(model_type, {}),
           **config_fields},
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Give the weights a realistic scale and a few outlier channels (the fused 3-D experts too).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                param.normal_(0, 0.05)
                param[..., :3] *= 8
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # routers
                param.normal_(0, 0.5)
    kwargs = {"max_shard_size": shards} if shards else {}
    model.save_pretrained(dest, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, dest / name)
    return dest


def make_tiny_gpt_oss(dest: Path, tokenizer_from: Path, **fields: object) -> Path:
    """A tiny GPT-OSS: 4 experts, 2 a token, a sliding layer (window 8) then a full one, with
    biases, sinks and a router drawn large enough to matter; `fields` as make_tiny's."""
    from safetensors.torch import load_file, save_file

    config = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128,
              "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, **fields}  # fmt: skip
    folder = make_tiny(dest, tokenizer_from, model_type="gpt_oss", **config)  # type: ignore[arg-type]
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.endswith(("_bias", "sinks", "router.weight")):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * 0.5
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def sharpen(folder: Path) -> Path:
    """Scale a tiny model's tied embedding up so that its next-token distributions are peaked:
    a random model's logits are nearly uniform over the 49k tokens, so that nothing done to it
    changes its perplexity much (distillation and gates need a model with something to lose)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.embed_tokens.weight"] *= 25
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "llama", default_model)


@pytest.fixture(scope="session")
def tiny_llama_sharded(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return make_tiny(
        tmp_path_factory.mktemp("tiny") / "llama-sharded",
        default_model,
        dtype=torch.bfloat16,
        shards="5MB",
    )


def assert_bad_input(result, fragment: str) -> None:
    """A CLI result that refused bad input: exit 2, one `error:` line naming it, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "error:" in result.output and fragment in result.output


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder no one may write: a read-only tmpfs for root (root ignores permission bits),
    mode 0555 for anyone else."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True
        )
        if mounted.returncode:
            pytest.skip("root, and cannot mount a read-only tmpfs here")
        yield folder
        subprocess.run(["umount", "-l", str(folder)], check=False)
    else:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
