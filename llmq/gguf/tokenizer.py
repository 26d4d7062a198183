"""A checkpoint's tokenizer (tokenizer.json) as llama.cpp reads it from a GGUF file.

Two kinds of BPE tokenizer are written, told apart by tokenizer.json itself:

- byte-level BPE (GPT-2's alphabet: SmolLM2, Llama 3, Qwen) as llama.cpp's "gpt2" model: every
  id's token and type, the merges, and the pre-tokenizer by the name llama.cpp gives its split.
- SentencePiece BPE (`byte_fallback`, spaces spelled "▁": Gemma, Llama 2, Mistral v1) as llama.cpp's
  "llama" model: tokens, a score each and types (BYTE for the <0xNN> fallbacks). llama.cpp merges
  the adjacent pair whose merged token scores highest; a SentencePiece BPE vocabulary lists its
  tokens best first, so each ordinary token scores minus its id, as the scores in
  SentencePiece's own model file fall with the id. Gemma's runs of two or more spaces are
  SentencePiece "user-defined" tokens, which llama.cpp matches whole in the raw text: they are
  written in real spaces as user-defined, as Gemma's own GGUF files hold them.

Special ids, whether to add BOS/EOS and the chat template come from `gguf.SpecialVocab`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf

from llmq.errors import InputError

# llama.cpp names a byte-level tokenizer's pre-tokenizer (how text is split before merges) rather
# than storing its regex; these are the pieces of the splits (all of a tokenizer's, joined) that
# tell the common ones apart, tried in order: DeepSeek-V3's CJK split before Llama 3's digit
# triples, which DeepSeek-V3 splits first too. A plain byte-level tokenizer (GPT-2's split, as
# SmolLM2's) is "gpt-2".
PRE_TOKENIZER_SPLITS = (
    ("gpt-4o", r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*"),
    ("deepseek-v3", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"),  # CJK, hiragana, katakana
    ("llama-bpe", r"\p{N}{1,3}"),
    ("qwen2", r"|\p{N}|"),
)
SPACE = "\u2581"  # SentencePiece's spelling of a space
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Scores SentencePiece's files give tokens that are not merged: control and user-defined tokens
_UNMERGED_SCORE = -1000.0


def pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, from the split regexes in its
    tokenizer.json; "gpt-2" where it splits as GPT-2 does."""
    node = spec.get("pre_tokenizer") or {}
    parts = node.get("pretokenizers", [node]) if node.get("type") == "Sequence" else [node]
    regexes = [
        (part.get("pattern") or {}).get("Regex") for part in parts if part.get("type") == "Split"
    ]
    joined = "\n".join(regex for regex in regexes if regex)
    if not joined:
        return "gpt-2"
    for name, marker in PRE_TOKENIZER_SPLITS:
        if marker in joined:
            return name
    raise InputError(
        "the tokenizer splits text with a regex llmq does not know a llama.cpp name for",
        hint=f"known: {', '.join(name for name, _ in PRE_TOKENIZER_SPLITS)}, gpt-2",
    )


def write_tokenizer(
    writer: gguf.GGUFWriter, folder: Path, vocab_size: int, *, spaces_user_defined: bool = False
) -> None:
    """The tokenizer of the checkpoint in `folder` as llama.cpp's "gpt2" (byte-level BPE) or
    "llama" (SentencePiece BPE) model; `spaces_user_defined`: the family's runs of spaces are
    user-defined tokens (Gemma)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{folder}: no tokenizer.json", hint="GGUF files carry the tokenizer")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise InputError(
            f"{path}: a {model.get('type')} tokenizer; llmq writes BPE ones to GGUF",
            hint="byte-level (GPT-2 alphabet) and SentencePiece (byte fallback) BPE",
        )
    if model.get("byte_fallback"):
        _write_sentencepiece(writer, spec, vocab_size, spaces_user_defined)
        merges = False
    else:
        _write_byte_level(writer, spec, vocab_size)
        merges = True
    gguf.SpecialVocab(folder, load_merges=merges, n_vocab=vocab_size).add_to_gguf(writer)


def _write_byte_level(writer: gguf.GGUFWriter, spec: dict[str, Any], vocab_size: int) -> None:
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, index in spec["model"]["vocab"].items():
        if index < vocab_size:
            tokens[index], types[index] = token, gguf.TokenType.NORMAL
    _mark_added(spec, tokens, types)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def _write_sentencepiece(
    writer: gguf.GGUFWriter, spec: dict[str, Any], vocab_size: int, spaces_user_defined: bool
) -> None:
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    scores = [_UNMERGED_SCORE] * vocab_size
    for token, index in spec["model"]["vocab"].items():
        if index >= vocab_size:
            continue
        if _BYTE_TOKEN.fullmatch(token):
            tokens[index], types[index], scores[index] = token, gguf.TokenType.BYTE, 0.0
        elif spaces_user_defined and len(token) > 1 and set(token) == {SPACE}:
            tokens[index], types[index] = " " * len(token), gguf.TokenType.USER_DEFINED
        else:
            tokens[index], types[index], scores[index] = token, gguf.TokenType.NORMAL, -float(index)
    _mark_added(spec, tokens, types)
    for index, kind in enumerate(types):
        if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED):
            scores[index] = _UNMERGED_SCORE
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(_adds_space_prefix(spec))


def _mark_added(spec: dict[str, Any], tokens: list[str], types: list[gguf.TokenType]) -> None:
    """Added tokens: special ones as CONTROL, others as USER_DEFINED (matched whole)."""
    for added in spec.get("added_tokens", []):
        index = added["id"]
        if index < len(tokens):
            tokens[index] = added["content"]
            types[index] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED  # fmt: skip


def _adds_space_prefix(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer puts a "▁" before the text (Llama 2's does, Gemma's does not)."""
    nodes = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    prepends = '"type": "Prepend"' in nodes
    metaspace = re.search(r'"prepend_scheme": "(first|always)"', nodes) is not None
    return prepends or metaspace
