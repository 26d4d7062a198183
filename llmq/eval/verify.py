"""`llmq verify`: load a checkpoint with each loader a user may deploy it with, run the recorded
prompts, and compare with the reference its `llmq.json` carries (see llmq.eval.logits).

Loaders: plain transformers (`AutoModelForCausalLM.from_pretrained`, float32), vLLM (`LLM`,
when it is importable) and llmq (`load_quantized`: its kernels, or the torch reference of the
same math on the CPU; schemes with no kernel run through llmq's evaluator). Each ends as one
of: ok, does not load (the reason in one line), wrong logits (how far off).
"""

from __future__ import annotations

import importlib.util
import io
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from llmq.calib.stream import resolve_device
from llmq.errors import InputError
from llmq.eval.logits import (
    LOGPROB_TOLERANCE,
    TOP_K,
    Distance,
    Reference,
    changed_files,
    compute_reference,
    distance,
    distance_on_top,
    evaluator_log_probs,
    padded,
    recorded_reference,
    unpadded,
)
from llmq.io.checkpoint import Checkpoint, open_checkpoint
from llmq.io.record import OutputRecord
from llmq.pack.format import DECOMPRESSED_TO_BFLOAT16, config_formats
from llmq.pack.loaders import LOADERS
from llmq.progress import NO_PROGRESS, Progress

Status = Literal["ok", "does not load", "wrong logits", "wrong tokens"]
_REASON_CHARS = 240
# Loaders that quantize activations differ from the reference by up to about the activation
# quantization's own effect (1.22 and 1.37 against 2.16 and 1.42 on the default model's W8A8
# and FP8 checkpoints): allowed twice that.
ACTIVATION_EFFECT_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class Comparison:
    """A loader's distance from the reference it is held to, and the tolerance."""

    distance: Distance
    tolerance: float
    reference: str  # "weights alone" or "as the format runs"
    measure: Literal["max", "mean"] = "max"  # which |Δ log-prob| the tolerance bounds

    @property
    def matches(self) -> bool:
        held = self.distance.max_abs if self.measure == "max" else self.distance.mean_abs
        return held <= self.tolerance


@dataclass(slots=True)
class LoaderResult:
    loader: str
    status: Status
    detail: str  # one line: the reason it does not load, or how far its logits are
    comparison: Comparison | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "ok"


@dataclass(slots=True)
class VerifyResult:
    checkpoint: str
    reference: str  # where the reference came from
    loaders: list[LoaderResult]
    changed_files: list[str] | None = None  # None: the checkpoint records no file hashes
    against: dict[str, Any] | None = None  # the distance to the original model

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.loaders) and not self.changed_files

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def installed_loaders() -> list[str]:
    """The loaders present here: transformers and llmq always, vLLM when importable."""
    return [name for name in LOADERS if name != "vllm" or importlib.util.find_spec("vllm")]


def check_loaders(names: list[str]) -> list[str]:
    """Validate requested loader names before any work."""
    for name in names:
        if name not in LOADERS:
            raise InputError(f"--loader: unknown loader {name!r}", hint=f"choose from: {', '.join(LOADERS)}")  # fmt: skip
        if name not in installed_loaders():
            raise InputError(f"--loader {name}: {name} is not installed", hint=f"pip install {name}")  # fmt: skip
    return names


def verify(
    folder: Path,
    *,
    loaders: list[str],
    against: Checkpoint | None = None,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> VerifyResult:
    ckpt = open_checkpoint(folder)
    record = OutputRecord.read(folder, strict=True)
    if not ckpt.quantization_config:  # a plain checkpoint: llmq prune's, or not llmq's at all
        if not record.to_dict():
            raise InputError(f"{folder}: not a quantized checkpoint (no quantization_config) and no llmq.json", hint="verify checks the output of `llmq quantize`, `llmq prune` or another compressed-tensors tool")  # fmt: skip
        loaders = [name for name in loaders if name != "llmq"]  # its kernels run quantized linears
        if not loaders:
            raise InputError(f"{folder}: a plain checkpoint (pruned, not quantized): llmq's kernels have nothing to run", hint="verify it with --loader transformers")  # fmt: skip
    changed = None
    if record.files is not None:
        with progress.stage("hashing files"):
            changed = changed_files(folder, record.files)
    reference = recorded_reference(record, folder)
    if reference is None:
        with progress.stage("computing the reference with llmq's evaluator"):
            reference = compute_reference(ckpt, device=device)
        source = "computed now by llmq's evaluator (the checkpoint records none)"
    else:
        source = f"recorded at quantize time ({reference.computed_by})"
    results = []
    for name in loaders:
        with progress.stage(f"loading with {name}"):
            results.append(run_loader(name, _LOADERS[name], folder, ckpt, reference, device))
    result = VerifyResult(str(folder), source, results, changed)
    if against is not None:
        result.against = distance_from(against, reference, progress, device)
    return result


def distance_from(
    original: Checkpoint, reference: Reference, progress: Progress, device: str | None
) -> dict[str, Any]:
    """How far the original model is from the reference (what quantization moved)."""
    with progress.stage(f"scoring the original model {original.path.name}"):
        log_probs = evaluator_log_probs(original, reference.input_ids, device=device)
    return {"model": str(original.path), **asdict(distance(reference.prompts, log_probs))}


class WrongTokens(Exception):
    """A loader reads the text into other token ids than the checkpoint's tokenizer does."""


Loader = Callable[[Path, Checkpoint, Reference, str | None], Comparison]
"""Loads the checkpoint at a path as one runtime does and compares its log-probabilities."""


def run_loader(
    name: str,
    load: Loader,
    path: Path,
    ckpt: Checkpoint,
    reference: Reference,
    device: str | None,
) -> LoaderResult:
    """`load`'s verdict on the checkpoint at `path`: ok, does not load, or wrong logits."""
    started = time.perf_counter()
    try:
        with _captured_output() as captured:
            measured = load(path, ckpt, reference, device)
    except WrongTokens as exc:
        return LoaderResult(name, "wrong tokens", str(exc), None, time.perf_counter() - started)
    except Exception as exc:  # any failure of a third-party loader is its verdict, in one line
        reason = _load_report_problem(captured) or _one_line(exc)
        return LoaderResult(name, "does not load", reason, None, time.perf_counter() - started)
    seconds = time.perf_counter() - started
    d = measured.distance
    detail = (
        f"max |Δ log-prob| {d.max_abs:.2g} (mean {d.mean_abs:.2g}, {measured.measure} tolerance {measured.tolerance:.2g}) "
        f"on the reference's top {TOP_K} tokens, {measured.reference}; its first token first at "
        f"{d.top1_agreement:.0%} of positions"
    )  # fmt: skip
    status: Status = "ok" if measured.matches else "wrong logits"
    return LoaderResult(name, status, detail, measured, seconds)


@contextmanager
def _captured_output() -> Iterator[list[str]]:
    """What a loader prints (progress bars on stderr) and logs (transformers' load report,
    which names the tensors that did not fit), kept from the user's screen and returned."""

    lines: list[str] = []
    logger = logging.getLogger("transformers")
    handler = _Collect(lines)
    saved = logger.level, logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.WARNING)
    stderr = io.StringIO()
    try:
        with redirect_stderr(stderr):
            yield lines
    finally:
        logger.setLevel(saved[0])
        logger.handlers, logger.propagate = saved[1], saved[2]
        lines.extend(stderr.getvalue().splitlines())


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().splitlines())


def _load_report_problem(lines: list[str]) -> str | None:
    """The first problem row of transformers' load report ('key | MISMATCH | note'), or None."""
    rows = [[cell.strip() for cell in line.split("|")] for line in lines if line.count("|") >= 2]
    problems = [row for row in rows if row[1] in ("MISMATCH", "MISSING", "UNEXPECTED")]
    if not problems:
        return None
    key, status, note = problems[0][:3]
    more = f" (and {len(problems) - 1} more rows)" if len(problems) > 1 else ""
    return f"{status.lower()}: {key}: {note}{more}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def _transformers(folder: Path, ckpt: Checkpoint, reference: Reference, device: str | None) -> Comparison:  # fmt: skip
    """Plain `from_pretrained` (FP4 and MX: dequantized at load), run on the weights alone: compressed-tensors' quantize-dequantize
    of activations (and of the already dequantized weights) turned off, so what is compared is
    exactly how transformers read the files."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    # FP4 and MX formats: dequantized at load time into the float32 model (transformers'
    # `dequantize=True`). Left compressed, compressed-tensors decompresses them to bfloat16 at
    # the first forward pass, which float32 inputs cannot meet. A mix of formats is left
    # compressed: dequantize=True reads one config group for every dense module (and a mix with
    # FP4 or MX groups loads neither way: `mixed_formats_support`).
    # (a quantization_config=None would load the compressed tensors as if unquantized)
    formats = config_formats(ckpt.quantization_config)
    dequantized = {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    bfloat16_only = formats & {f.value for f in DECOMPRESSED_TO_BFLOAT16}
    extra = dequantized if bfloat16_only and len(formats) == 1 else {}
    with warnings.catch_warnings():  # that the checkpoint's own config wins: as intended
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra)
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            module.quantization_enabled = False
    log_probs = model_log_probs(model.to(resolve_device(device)), reference.input_ids)
    return Comparison(distance(reference.weights(), log_probs), LOGPROB_TOLERANCE, "weights alone")


def _llmq(folder: Path, ckpt: Checkpoint, reference: Reference, device: str | None) -> Comparison:
    """llmq's kernels (the torch reference of their math on the CPU). Schemes with no kernel
    (W8A16, FP8 blocks, a KV cache) run through llmq's evaluator on the files as they are now."""
    from llmq.runtime.load import load_quantized

    try:
        model = load_quantized(ckpt, device=device)
    except InputError as exc:
        if "no llmq kernel" not in exc.message:
            raise
        log_probs = evaluator_log_probs(ckpt, reference.input_ids, device=device)
        return Comparison(distance(reference.prompts, log_probs), LOGPROB_TOLERANCE, "as the format runs")  # fmt: skip
    log_probs = model_log_probs(model, reference.input_ids)
    return _as_run(distance(reference.prompts, log_probs), reference)


def _as_run(measured: Distance, reference: Reference) -> Comparison:
    """A loader that quantizes activations itself, held to twice the activations' own effect
    (see `Reference`): a loader that misreads a tensor lands far beyond it."""
    tolerance = LOGPROB_TOLERANCE + ACTIVATION_EFFECT_FACTOR * reference.activation_effect
    return Comparison(measured, tolerance, "as the format runs")


@torch.inference_mode()
def model_log_probs(model: Any, ids: list[list[int]]) -> list[Tensor]:
    device = next(model.parameters()).device
    logits = model(padded(ids).to(device)).logits.float()
    return unpadded(torch.log_softmax(logits, dim=-1).cpu(), ids)


def _vllm(folder: Path, ckpt: Checkpoint, reference: Reference, device: str | None) -> Comparison:
    """vLLM reports log-probabilities of its top tokens, not logits: position p's distribution
    is prompt_logprobs[p + 1], the last position's that of the one generated token. A reference
    token outside the top 2 x TOP_K vLLM returns counts at vLLM's lowest returned value (an
    upper bound on its own)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * TOP_K, prompt_logprobs=2 * TOP_K)  # fmt: skip
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in reference.input_ids], params)  # fmt: skip
    return _as_run(distance_on_top(reference.prompts, vllm_top_values(reference, outputs)), reference)  # fmt: skip


def vllm_top_values(reference: Reference, outputs: list[Any]) -> list[Tensor]:
    """Per prompt, vLLM's log-probabilities of the reference's top tokens [positions, TOP_K],
    from its `RequestOutput`s: `prompt_logprobs[p + 1]` is the distribution after position p
    (entry 0 is None: nothing predicts the first token), the generated token's `logprobs[0]`
    the one after the last position."""
    values = []
    for prompt, output in zip(reference.prompts, outputs, strict=True):
        positions = [*output.prompt_logprobs[1:], output.outputs[0].logprobs[0]]
        rows = []
        for top_ids, returned in zip(prompt.top_ids, positions, strict=True):
            floor = min(entry.logprob for entry in returned.values())
            rows.append([returned[i].logprob if i in returned else floor for i in top_ids])
        values.append(torch.tensor(rows))
    return values


_LOADERS: dict[str, Loader] = {
    "transformers": _transformers,
    "vllm": _vllm,
    "llmq": _llmq,
}
