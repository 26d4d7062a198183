"""Text for calibration and evaluation, tokenized into fixed-length windows.

A text source is a built-in name (see `llmq.texts`), several joined with '+', a local .txt /
.jsonl / .parquet file, or a dataset already in the local Hugging Face cache; files and
datasets are read with the `datasets` library. Calibration draws random windows from a seeded
generator (reproducible); evaluation takes consecutive windows from the start (never sampled).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmq.calib.tokenizer import TextTokenizer
from llmq.errors import InputError
from llmq.io.cache import read_cached, write_cached
from llmq.texts import BUILTIN_TEXTS, Split, builtin_documents

_FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True, slots=True)
class TokenWindows:
    """input_ids [windows, seq_len] (int64) and where they came from."""

    input_ids: Tensor
    source: str
    add_bos: bool

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def load_documents(source: str, split: Split) -> list[str]:
    """Documents of one source (not '+'-joined); built-ins give the requested split."""
    if source in BUILTIN_TEXTS:
        return builtin_documents(source, split)
    path = Path(source)
    if path.suffix.lower() in _FILE_BUILDERS or path.exists():
        return _file_documents(path)
    return _cached_dataset_documents(source)


def _file_documents(path: Path) -> list[str]:
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    builder = _FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise InputError(f"{path}: unsupported text file type", hint="use .txt, .jsonl or .parquet")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: file is empty")
    import datasets

    try:
        data = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for unreadable files
        raise InputError(f"{path}: cannot read as {builder} ({type(exc).__name__})") from None
    docs = _text_column(data, str(path))
    return ["\n".join(docs)] if builder == "text" else docs


def _cached_dataset_documents(name: str) -> list[str]:
    import datasets

    try:
        data = datasets.load_dataset(name, split="train")
    except Exception:  # offline, not cached, or not a dataset: one clear line either way
        raise InputError(
            f"text {name!r} is not a built-in, a file, or a dataset in the local cache",
            hint=f"built-ins: {', '.join(BUILTIN_TEXTS)}; files: .txt, .jsonl, .parquet",
        ) from None
    return _text_column(data, name)


def _text_column(data: Any, where: str) -> list[str]:
    if "text" not in data.column_names:
        raise InputError(f"{where}: no 'text' column (found: {', '.join(data.column_names)})")
    docs = [doc for doc in data["text"] if isinstance(doc, str) and doc.strip()]
    if not docs:
        raise InputError(f"{where}: contains no text")
    return docs


def _token_stream(tokenizer: TextTokenizer, docs: list[str]) -> Tensor:
    """Token ids of the documents joined by blank lines, cached on disk per (tokenizer, text):
    tokenizing all of Shakespeare takes seconds, reading it back milliseconds."""
    from llmq.models import cache_dir

    text = "\n\n".join(docs)
    key = hashlib.sha256(tokenizer.fingerprint.encode() + b"\0" + text.encode()).hexdigest()
    path = cache_dir() / "tokens" / f"{key[:32]}.i32"
    cached = read_cached(path, _load_token_ids)
    if cached is not None:
        return cached
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    write_cached(path, lambda partial: partial.write_bytes(ids.to(torch.int32).numpy().tobytes()))
    return ids


def _load_token_ids(path: Path) -> Tensor:
    """Token ids stored as raw int32; ValueError for a file that cannot hold them."""
    data = path.read_bytes()
    if not data or len(data) % 4:
        raise ValueError(f"{len(data)} bytes is not a whole number of int32 token ids")
    return torch.frombuffer(bytearray(data), dtype=torch.int32).to(torch.int64)


def _with_bos(windows: Tensor, tokenizer: TextTokenizer) -> Tensor:
    """Every window starts with BOS when the tokenizer starts sequences with it."""
    if not tokenizer.add_bos:
        return windows
    bos = torch.full((windows.shape[0], 1), int(tokenizer.bos_token_id), dtype=torch.int64)
    return torch.cat([bos, windows[:, :-1]], dim=1)


def calibration_windows(
    tokenizer: TextTokenizer, text: str, *, num_samples: int, seq_len: int, seed: int
) -> TokenWindows:
    """`num_samples` random windows of `seq_len` tokens, spread evenly over '+'-joined sources."""
    sources = [s for s in text.split("+") if s]
    if not sources:
        raise InputError("empty calibration text name")
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for i, source in enumerate(sources):
        count = num_samples // len(sources) + (i < num_samples % len(sources))
        if count == 0:
            continue
        stream = _token_stream(tokenizer, load_documents(source, "calibration"))
        if stream.numel() < seq_len:
            raise InputError(
                f"calibration text {source!r} has {stream.numel()} tokens, fewer than "
                f"--seq-len {seq_len}"
            )
        starts = torch.randint(0, stream.numel() - seq_len + 1, (count,), generator=generator)
        parts.append(torch.stack([stream[s : s + seq_len] for s in starts.tolist()]))
    return TokenWindows(_with_bos(torch.cat(parts), tokenizer), text, tokenizer.add_bos)


def evaluation_windows(
    tokenizer: TextTokenizer, text: str, *, seq_len: int, max_windows: int | None
) -> TokenWindows:
    """Consecutive, non-overlapping windows from the start of the held-out split."""
    return _consecutive_windows(tokenizer, text, "heldout", seq_len, max_windows, "evaluation")


def training_windows(tokenizer: TextTokenizer, text: str, *, seq_len: int) -> TokenWindows:
    """Every consecutive, non-overlapping window of the calibration split (what `distill`
    trains on; evaluation reads the held-out split, so it never scores trained-on text)."""
    return _consecutive_windows(tokenizer, text, "calibration", seq_len, None, "training")


def _consecutive_windows(
    tokenizer: TextTokenizer,
    text: str,
    split: Split,
    seq_len: int,
    max_windows: int | None,
    purpose: str,
) -> TokenWindows:
    docs = [doc for source in text.split("+") if source for doc in load_documents(source, split)]
    stream = _token_stream(tokenizer, docs)
    count = stream.numel() // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise InputError(f"{purpose} text {text!r} has fewer than --seq-len {seq_len} tokens")
    windows = stream[: count * seq_len].reshape(count, seq_len)
    return TokenWindows(_with_bos(windows, tokenizer), text, tokenizer.add_bos)
