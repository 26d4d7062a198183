"""The tokenizer llmq needs for text: encode, the BOS id, and whether sequences start with BOS.

Checkpoints ship `tokenizer.json`; reading it with the `tokenizers` library takes a fifth of a
second, where transformers' AutoTokenizer takes seconds of imports on every command. Folders
without it fall back to AutoTokenizer. The fingerprint (a hash of the tokenizer files) keys the
token cache, so a cache hit needs no tokenizer at all.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmq.errors import InputError

_CONFIG_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(slots=True)
class TextTokenizer:
    folder: Path
    fingerprint: str
    _backend: Any = field(default=None, repr=False)

    def _load(self) -> Any:
        if self._backend is None:
            self._backend = _load_backend(self.folder)
        return self._backend

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens."""
        return self._load().encode(text)

    def vocabulary(self) -> dict[str, int]:
        """Every token (added ones too) and its id: what two models must share to be compared
        token by token (distillation). Files can differ (a chat template) and still agree."""
        return self._load().vocabulary()

    @property
    def bos_token_id(self) -> int | None:
        return self._load().bos_token_id

    @property
    def add_bos(self) -> bool:
        """Whether the tokenizer starts every sequence with BOS (then so does every window)."""
        return self._load().add_bos


def load_tokenizer(folder: Path) -> TextTokenizer:
    """The checkpoint's tokenizer, loaded lazily; its fingerprint is computed from its files."""
    files = [folder / name for name in _CONFIG_FILES if (folder / name).is_file()]
    if not files:
        raise InputError(
            f"{folder}: no tokenizer files", hint="copy the tokenizer next to config.json"
        )
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return TextTokenizer(folder=folder, fingerprint=digest.hexdigest()[:32])


@dataclass(slots=True)
class _FastBackend:
    """tokenizer.json through the `tokenizers` library."""

    tokenizer: Any
    bos_token_id: int | None
    add_bos: bool

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def vocabulary(self) -> dict[str, int]:
        return dict(self.tokenizer.get_vocab(with_added_tokens=True))


@dataclass(slots=True)
class _TransformersBackend:
    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def vocabulary(self) -> dict[str, int]:
        return dict(self.tokenizer.get_vocab())

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def add_bos(self) -> bool:
        return self.bos_token_id is not None and bool(
            getattr(self.tokenizer, "add_bos_token", False)
        )


def _load_backend(folder: Path) -> Any:
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the Rust library raises a bare Exception for bad files
            raise InputError(f"{folder / 'tokenizer.json'}: cannot load ({exc})") from None
        bos_id = _bos_id(folder, tokenizer)
        # BOS is added by the post-processor stored in tokenizer.json, when there is one.
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        return _FastBackend(tokenizer, bos_id, bos_id is not None and probe[:1] == [bos_id])
    from transformers import AutoTokenizer

    try:
        return _TransformersBackend(AutoTokenizer.from_pretrained(folder))
    except (OSError, ValueError) as exc:
        raise InputError(f"{folder}: cannot load a tokenizer ({exc})") from None


def _bos_id(folder: Path, tokenizer: Any) -> int | None:
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    bos = json.loads(config_path.read_text()).get("bos_token")
    if isinstance(bos, dict):  # older configs store AddedToken dicts
        bos = bos.get("content")
    return None if bos is None else tokenizer.token_to_id(bos)
