"""`llmq verify FILE.gguf`: does a runtime compute the model a GGUF file's tensors define?

The reference is computed now: llmq's evaluator on the source checkpoint's architecture with
each tensor as the file holds it, decoded by the `gguf` package (llmq.gguf.read). A loader
reads the file its own way (its tensor names, its q/k order, the hyperparameters and tokenizer
in the file's metadata) and is held to that reference like any checkpoint's loader. Loaders:
transformers' GGUF reader (`from_pretrained(gguf_file=...)`, dequantized to float32).
llama.cpp is not yet one (its logits are not exported in a form llmq reads).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmq.calib.stream import resolve_device
from llmq.errors import InputError
from llmq.eval.logits import LOGPROB_TOLERANCE, Reference, compute_reference, distance
from llmq.eval.verify import (
    Comparison,
    Loader,
    VerifyResult,
    distance_from,
    model_log_probs,
    run_loader,
)
from llmq.eval.verify_llamacpp import (
    LLAMA_CPP_ENV,
    PERPLEXITY,
    find_llama_perplexity,
    llama_cpp_loader,
    require_llama_perplexity,
)
from llmq.gguf.model import gguf_arch, rope_of
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress


def _transformers(path: Path, ckpt: Checkpoint, reference: Reference, device: str | None) -> Comparison:  # fmt: skip
    """transformers' GGUF reader: names, q/k order, hyperparameters from the file's metadata."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)  # fmt: skip
    log_probs = model_log_probs(model.eval().to(resolve_device(device)), reference.input_ids)
    return Comparison(distance(reference.prompts, log_probs), LOGPROB_TOLERANCE, "weights alone")


GGUF_LOADERS: dict[str, Loader] = {"transformers": _transformers, "llama.cpp": llama_cpp_loader}


def gguf_loaders(requested: list[str] | None, source: Checkpoint) -> list[str]:
    """The loaders a GGUF file is verified with: by default transformers where its GGUF reader
    builds the family, and llama.cpp when its binaries are found; another one asked for is
    refused, llama.cpp without its binaries too (and nothing left to verify with)."""
    for name in requested or []:
        if name not in GGUF_LOADERS:
            raise InputError(f"--loader {name}: a GGUF file is verified with {', '.join(GGUF_LOADERS)}", hint="llmq and vLLM loaders read compressed-tensors folders")  # fmt: skip
        if name == "llama.cpp":
            require_llama_perplexity()
    if requested:
        return list(requested)
    # transformers' reader builds neither Mixtral nor OLMoE, and ignores rope scaling
    reads = gguf_arch(source.config).transformers_reads
    loaders = ["transformers"] if reads and rope_of(source.model_config()).scaling is None else []
    if find_llama_perplexity():
        loaders.append("llama.cpp")
    if not loaders:
        raise InputError(
            f"{source.config.get('model_type')}: transformers' GGUF reader does not build this model, and llama.cpp's {PERPLEXITY} is not found",
            hint=f"build llama.cpp (benchmarks/peers/setup_llamacpp.sh) and set {LLAMA_CPP_ENV} to its bin folder",
        )  # fmt: skip
    return loaders


def verify_gguf(
    path: Path,
    source: Checkpoint,
    *,
    loaders: list[str],
    against: Checkpoint | None = None,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> VerifyResult:
    """Hold each loader's reading of the GGUF file at `path` to the model its tensors define
    on `source`'s architecture; `against`: also the distance of the original model."""
    from llmq.gguf.read import gguf_as_checkpoint

    ckpt = gguf_as_checkpoint(source, path)
    with progress.stage("computing the reference from the file's tensors"):
        reference = compute_reference(ckpt, device=device)
    results = []
    for name in loaders:
        with progress.stage(f"loading with {name}"):
            results.append(run_loader(name, GGUF_LOADERS[name], path, ckpt, reference, device))
    described = f"computed now by llmq's evaluator: {source.path}'s architecture, the file's tensors as the gguf package decodes them"  # fmt: skip
    result = VerifyResult(str(path), described, results)
    if against is not None:
        result.against = distance_from(against, reference, progress, device)
    return result
