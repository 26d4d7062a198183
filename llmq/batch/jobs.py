"""A jobs file: which models, which recipes, and which recipes apply to which models; expanded
into `Job`s, each keyed by what its output depends on.

    models: [smollm2-135m, ./my-llama]            # folders or built-in names
    recipes: [recipes/w8a16.yaml, recipes/w4a16-gptq.yaml]
    # optional: an inline recipe has a name and its stages
    #   - {name: fp8, stages: [{quantize: {scheme: fp8}}]}
    # optional: restrict some models to some recipes (by name); other models get every recipe
    #   only: {./my-llama: [w4a16-gptq]}

Every error names the file and line (exit 2) before any job starts: an unknown model, a recipe
that does not validate, a name used twice, an `only` entry naming nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmq.errors import InputError
from llmq.recipes.load import Location, RecipeSource, effective, locate, parse_recipe, read_yaml

JOBS_KEYS = ("models", "recipes", "only")


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str  # the folder name under OUT
    spec: str  # what the user wrote: a built-in name or a folder


@dataclass(frozen=True, slots=True)
class RecipeEntry:
    name: str  # the folder name under OUT/<model>/
    source: RecipeSource


@dataclass(frozen=True, slots=True)
class Job:
    model: ModelEntry
    recipe: RecipeEntry

    @property
    def id(self) -> str:
        return f"{self.model.name}/{self.recipe.name}"


@dataclass(frozen=True, slots=True)
class JobsFile:
    path: Path
    models: list[ModelEntry]
    recipes: list[RecipeEntry]
    jobs: list[Job]


def safe_name(text: str) -> str:
    """A folder name from a model spec or recipe file: its last path part, other characters
    than letters, digits, '.', '_' and '-' as '-'."""
    stem = Path(text.rstrip("/")).name or text
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-") or "model"


def load_jobs(path: Path) -> JobsFile:
    """Parse and validate a jobs file (recipes loaded and checked stage by stage)."""
    from llmq.api.chain import check_recipe

    data, _, lines = read_yaml(path, "jobs file")
    here = _Where(path, lines)
    if not isinstance(data, dict) or not data.get("models") or not data.get("recipes"):
        raise InputError(f"{path}: a jobs file is a mapping with `models` and `recipes` lists")
    unknown = sorted(set(data) - set(JOBS_KEYS))
    if unknown:
        raise InputError(f"{here((unknown[0],))}: unknown key (expected {', '.join(JOBS_KEYS)})")
    models = [_model(item, here, ("models", i)) for i, item in enumerate(_list(data, "models", here))]  # fmt: skip
    recipes = []
    for i, item in enumerate(_list(data, "recipes", here)):
        entry = _recipe(item, path.parent, here, ("recipes", i))
        check_recipe(entry.source)  # every stage's options, as its command checks them
        recipes.append(entry)
    _unique([m.name for m in models], "model", here, "models")
    _unique([r.name for r in recipes], "recipe", here, "recipes")
    only = _only(data.get("only") or {}, models, recipes, here)
    jobs = [
        Job(model, recipe)
        for model in models
        for recipe in recipes
        if model.name not in only or recipe.name in only[model.name]
    ]
    return JobsFile(path, models, recipes, jobs)


class _Where:
    """'FILE:LINE: key' for a place in the jobs file."""

    def __init__(self, path: Path, lines: dict[Location, int]) -> None:
        self.path, self.lines = path, lines

    def __call__(self, location: Location) -> str:
        return locate(self.path, self.lines, location)


def _list(data: dict[str, Any], key: str, here: _Where) -> list[Any]:
    value = data[key]
    if not isinstance(value, list):
        raise InputError(f"{here((key,))}: expected a list")
    return value


def _model(item: Any, here: _Where, location: Location) -> ModelEntry:
    from llmq.models import is_builtin

    if not isinstance(item, str) or not item:
        raise InputError(f"{here(location)}: a model is a folder or a built-in name")
    folder = (here.path.parent / item) if not Path(item).is_absolute() else Path(item)
    if is_builtin(item):
        return ModelEntry(item, item)
    if not (folder / "config.json").is_file():
        raise InputError(
            f"{here(location)}: model {item!r}: no such folder with a config.json, and not a "
            "built-in name",
            hint="`llmq models` lists the built-in names",
        )
    return ModelEntry(safe_name(item), str(folder.resolve()))


def _recipe(item: Any, base: Path, here: _Where, location: Location) -> RecipeEntry:
    from llmq.recipes.load import load_recipe

    if isinstance(item, str):
        file = base / item if not Path(item).is_absolute() else Path(item)
        if not file.is_file():
            raise InputError(f"{here(location)}: recipe file {item!r} not found")
        return RecipeEntry(safe_name(file.stem), load_recipe(file))
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        body = {k: v for k, v in item.items() if k != "name"}
        # the inline recipe's own keys, with their lines in the jobs file
        lines = {key[2:]: line for key, line in here.lines.items() if key[:2] == location}
        return RecipeEntry(safe_name(item["name"]), parse_recipe(body, here.path, lines))
    raise InputError(
        f"{here(location)}: a recipe is a file name or a mapping with `name` and `stages`"
    )


def _unique(names: list[str], what: str, here: _Where, key: str) -> None:
    seen: set[str] = set()
    for index, name in enumerate(names):
        if name in seen:
            raise InputError(
                f"{here((key, index))}: two {what}s named {name!r} (their output folder)"
            )
        seen.add(name)


def _only(
    data: Any, models: list[ModelEntry], recipes: list[RecipeEntry], here: _Where
) -> dict[str, set[str]]:
    if not isinstance(data, dict):
        raise InputError(f"{here(('only',))}: expected a mapping of model to recipe names")
    by_spec = {m.spec: m.name for m in models} | {m.name: m.name for m in models}
    names = {r.name for r in recipes}
    only: dict[str, set[str]] = {}
    for model, wanted in data.items():
        key = by_spec.get(model) or by_spec.get(str((here.path.parent / model).resolve()))
        if key is None:
            raise InputError(f"{here(('only', model))}: {model!r} is not one of `models`")
        wanted = [wanted] if isinstance(wanted, str) else wanted
        missing = [w for w in wanted if safe_name(w) not in names]
        if missing:
            raise InputError(f"{here(('only', model))}: no recipe named {missing[0]!r}")
        only[key] = {safe_name(w) for w in wanted}
    return only


def job_key(job: Job, model_dir: Path) -> str:
    """What a job's output depends on: the model's files (path, size and mtime of every shard,
    the config's bytes) and the effective recipe. A changed recipe or model re-runs the job."""
    from llmq.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    material = {
        "files": ckpt.file_stamps(),
        "config": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "recipe": effective(job.recipe.source.recipe),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
