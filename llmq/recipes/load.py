"""Recipe files: YAML in, a validated `ChainRecipe` out, and every error pointing at its line.

`load_recipe` reports an unknown key, a wrong type or an impossible combination as
`FILE:LINE: stages[0].quantize.group_sise: ...` (InputError, exit 2) before any work. The
effective recipe (defaults filled in) dumps back to YAML that loads into the same object.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from llmq.errors import InputError
from llmq.recipes.schema import STAGES, ChainRecipe, StageEntry, StageError

Location = tuple[str | int, ...]
STAGES_HINT = (
    "a recipe is a mapping with a `stages` list, e.g. stages: [{quantize: {scheme: w4a16}}]"
)


@dataclass(frozen=True, slots=True)
class RecipeSource:
    """A recipe and where each of its keys was written (for error messages)."""

    recipe: ChainRecipe
    path: Path | None = None
    lines: dict[Location, int] = field(default_factory=dict)  # 1-based

    def where(self, location: Location) -> str:
        return locate(self.path, self.lines, location)


def locate(path: Path | None, lines: dict[Location, int], location: Location) -> str:
    """'FILE:LINE: stages[0].quantize.key' for the deepest part of `location` written."""
    line = next(
        (lines[location[:n]] for n in range(len(location), -1, -1) if location[:n] in lines),
        None,
    )
    place = "" if path is None else f"{path}:{line}: " if line else f"{path}: "
    return place + dotted(location)


def dotted(location: Location) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def load_recipe(path: Path) -> RecipeSource:
    return parse_recipe(*read_yaml(path, "recipe"))


def read_yaml(path: Path, what: str) -> tuple[Any, Path, dict[Location, int]]:
    """A YAML file's data, its path, and the line of each key (errors name FILE:LINE)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError(
            f"{path}:{line}: the {what} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
            hint="save it as UTF-8",
        ) from None
    try:
        return yaml.safe_load(text), path, key_lines(yaml.compose(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None  # fmt: skip


def parse_recipe(
    data: Any, path: Path | None = None, lines: dict[Location, int] | None = None
) -> RecipeSource:
    """A recipe from already-parsed data (a dict, as YAML gives it)."""
    source = RecipeSource(ChainRecipe.model_construct(stages=[]), path, lines or {})
    if not isinstance(data, dict):
        raise InputError(f"{path or 'recipe'}: not a recipe", hint=STAGES_HINT)
    try:
        recipe = ChainRecipe.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        error = first.get("ctx", {}).get("error")
        location = ("stages", error.index) if isinstance(error, StageError) else _plain(first["loc"])  # fmt: skip
        if first["type"] == "extra_forbidden":
            message, hint = _unknown_key(location)
            raise InputError(f"{source.where(location)}: {message}", hint=hint) from None
        if first["type"] == "missing" and location == ("stages",):
            raise InputError(f"{source.where(location)}: missing", hint=STAGES_HINT) from None
        raise InputError(f"{source.where(location)}: {message}") from None
    return RecipeSource(recipe, path, lines or {})


def _unknown_key(location: Location) -> tuple[str, str]:
    """The message and hint for a key no model at `location` has: the keys it could be."""
    model: type[BaseModel] = ChainRecipe
    for part in location[:-1]:
        if isinstance(part, int):
            continue
        model = StageEntry if model is ChainRecipe else STAGES[str(part)]
    key = str(location[-1])
    if model is StageEntry:
        return f"unknown stage kind {key!r}", f"a stage is one of: {', '.join(STAGES)}"
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(key, allowed, n=1)
    guess = f"did you mean {close[0]}? " if close else ""
    return f"unknown key {key!r}", f"{guess}keys: {', '.join(allowed)}"


def _plain(loc: tuple[Any, ...]) -> Location:
    """pydantic's error location without the names of union members or validators."""
    return tuple(part for part in loc if isinstance(part, int) or not str(part).startswith("function-"))  # fmt: skip


def key_lines(node: Any, location: Location = ()) -> dict[Location, int]:
    """Where each mapping key and list item of a composed YAML tree starts."""
    lines: dict[Location, int] = {}
    if node is None:
        return lines
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            here = (*location, key.value)
            lines[here] = key.start_mark.line + 1
            lines.update(key_lines(value, here))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            here = (*location, index)
            lines[here] = item.start_mark.line + 1
            lines.update(key_lines(item, here))
    return lines


def effective(recipe: ChainRecipe) -> dict[str, Any]:
    """The recipe with every default filled in, as plain data (what runs record)."""
    return {
        "stages": [{entry.kind: entry.stage.model_dump(mode="json")} for entry in recipe.stages]
    }


def dump_recipe(recipe: ChainRecipe) -> str:
    return yaml.safe_dump(effective(recipe), sort_keys=False)
