"""What every verb of the API shares: opening a model, its options, the built-in models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmq.errors import InputError
from llmq.models import BUILTIN_MODELS, cache_dir, resolve_model
from llmq.progress import NO_PROGRESS, Progress


def _open(model: str | Path, progress: Progress = NO_PROGRESS) -> Any:
    from llmq.io.checkpoint import open_checkpoint

    return open_checkpoint(resolve_model(model, progress=progress))


def list_models() -> list[dict[str, Any]]:
    """The built-in models: name, description, and whether they are already cached."""
    return [
        {
            "name": m.name,
            "description": m.description,
            "cached": (cache_dir() / "models" / m.name / "config.json").is_file(),
        }
        for m in BUILTIN_MODELS.values()
    ]


def options_of(kind: type[Any], options: Any, values: dict[str, Any]) -> Any:
    """The options object given, or built from keywords (not both): what each verb takes."""
    if options is not None and values:
        raise InputError(f"give the options as a {kind.__name__} or as keywords, not both")
    if options is None:
        return kind.of(**values)
    if not isinstance(options, kind):
        raise InputError(f"options: expected {kind.__name__}, got {type(options).__name__}")
    return options
