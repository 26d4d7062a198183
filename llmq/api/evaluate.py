"""`evaluate` (perplexity and gates) and `verify` (where a checkpoint loads, with which logits)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.api.common import (
    _open,
)
from llmq.errors import InputError
from llmq.io.checkpoint import recorded_sparsity
from llmq.models import cache_dir, resolve_model
from llmq.pipeline.output import weights_size
from llmq.progress import NO_PROGRESS, Progress

if TYPE_CHECKING:
    from llmq.eval.verify import VerifyResult
from llmq.texts import DEFAULT_EVAL_TEXT


@dataclass(slots=True)
class EvalResult:
    """Perplexities under one protocol, the baseline's if given, and the gate's verdict."""

    protocol: dict[str, Any]
    model: Any  # Perplexity
    baseline: Any | None = None
    max_ppl_increase: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # bytes of safetensors per checkpoint ("model", and "baseline" when given)
    size_bytes: dict[str, int] = field(default_factory=dict)
    sparsity: float | None = None  # the share of zeros in the pruned linears, from llmq.json

    @property
    def increase(self) -> float | None:
        if self.baseline is None:
            return None
        return self.model.perplexity / self.baseline.perplexity - 1.0

    @property
    def passed(self) -> bool | None:
        if self.max_ppl_increase is None or self.increase is None:
            return None
        return self.increase <= self.max_ppl_increase

    def to_dict(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "model": asdict(self.model),
            "baseline": None if self.baseline is None else asdict(self.baseline),
            "increase": self.increase,
            "max_ppl_increase": self.max_ppl_increase,
            "passed": self.passed,
            "size_bytes": self.size_bytes,
            "sparsity": self.sparsity,
        }


def evaluate(
    model: str | Path,
    *,
    baseline: str | Path | None = None,
    text: str = DEFAULT_EVAL_TEXT,
    seq_len: int = 512,
    max_windows: int | None = 40,
    max_ppl_increase: float | None = None,
    use_cache: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> EvalResult:
    """Token perplexity of MODEL on held-out text, optionally against BASELINE (same windows).

    max_ppl_increase (e.g. 0.03 for 3%) makes it a gate: `result.passed` is False when the
    relative increase over the baseline exceeds it. Baseline results are cached per
    (checkpoint, windows), so repeated gates against one baseline score it once.
    """
    from llmq.calib.data import evaluation_windows
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.eval.ppl import cached_perplexity

    if seq_len < 8:
        raise InputError(f"--seq-len {seq_len}: must be >= 8")
    if max_windows is not None and max_windows < 1:
        raise InputError(f"--eval-windows {max_windows}: must be >= 1")
    if max_ppl_increase is not None and baseline is None:
        raise InputError("--max-ppl-increase needs --baseline")
    if max_ppl_increase is not None and not 0 <= max_ppl_increase < 100:
        raise InputError(f"--max-ppl-increase {max_ppl_increase}: out of range")
    ckpt = _open(model, progress)
    base_ckpt = _open(baseline, progress) if baseline is not None else None
    windows = evaluation_windows(
        load_tokenizer(ckpt.path), text, seq_len=seq_len, max_windows=max_windows
    )
    cache = cache_dir() / "ppl" if use_cache else None
    base = None
    if base_ckpt is not None:
        base = cached_perplexity(base_ckpt, windows, cache, progress=progress, device=device)
    result = cached_perplexity(ckpt, windows, None, progress=progress, device=device)
    protocol = {
        "metric": "token perplexity",
        "text": f"{text} (held-out split)",
        "windows": int(windows.input_ids.shape[0]),
        "seq_len": seq_len,
        "stride": seq_len,
        "bos": windows.add_bos,
        "dtype": "float32",
        "tokens_scored": result.tokens,
    }
    sizes = {"model": weights_size(ckpt.path)}
    if base_ckpt is not None:
        sizes["baseline"] = weights_size(base_ckpt.path)
    return EvalResult(
        protocol=protocol, model=result, baseline=base, max_ppl_increase=max_ppl_increase,
        size_bytes=sizes, sparsity=recorded_sparsity(ckpt.path),
    )  # fmt: skip


def verify(
    path: str | Path,
    *,
    loaders: list[str] | None = None,
    against: str | Path | None = None,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> VerifyResult:
    """Load the checkpoint at PATH with each loader (default: every installed one of
    transformers, vllm, llmq), run the prompts its `llmq.json` records and compare their
    log-probabilities with the recorded reference, and its files with their recorded hashes.
    `against`: also the distance of the original model. Returns a `VerifyResult`
    (`.passed` False when a loader fails or a file changed)."""
    from llmq.eval.verify import check_loaders, installed_loaders
    from llmq.eval.verify import verify as run

    if Path(path).is_file():
        return _verify_gguf(Path(path), loaders, against, progress, device)
    names = check_loaders(list(loaders)) if loaders else installed_loaders()
    folder = resolve_model(path, progress=progress)
    if not folder.is_dir():
        raise InputError(f"{path}: not a folder", hint="verify reads a checkpoint folder or a GGUF file")  # fmt: skip
    original = _open(against, progress) if against is not None else None
    return run(folder, loaders=names, against=original, progress=progress, device=device)


def _verify_gguf(
    path: Path,
    loaders: list[str] | None,
    against: str | Path | None,
    progress: Progress,
    device: str | None,
) -> VerifyResult:
    """A GGUF file, held to the model its tensors define on its source's architecture (the
    checkpoint it records, or `against`)."""
    from llmq.eval.verify_gguf import gguf_loaders, verify_gguf
    from llmq.gguf.read import is_gguf, recorded_source

    if not is_gguf(path):
        raise InputError(f"{path}: not a folder or a GGUF file", hint="verify reads a checkpoint folder or a GGUF file")  # fmt: skip
    source = against if against is not None else recorded_source(path)
    if source is None:
        raise InputError(f"{path}: records no source checkpoint (not written by llmq)", hint="name it: --baseline MODEL")  # fmt: skip
    original = _open(source, progress)
    names = gguf_loaders(loaders, original)
    return verify_gguf(path, original, loaders=names, against=original if against is not None else None, progress=progress, device=device)  # fmt: skip
