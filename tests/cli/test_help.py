"""`--help` reads at 80 columns: no line longer, every option by its full name, short enough to
scan. The details live in docs/, so each page is a budget, not a manual."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer

from llmq.cli.main import app
from llmq.cli.options import old_spellings

WIDTH = 80

# Lines of each --help at 80 columns: a little above what it takes today, so that an option
# that grows into a paragraph, or a new one that does not fit, shows up here.
BUDGETS = {
    "quantize": 160,  # + --format gguf and its options, --stage-activations, --tf32, model-free, FP4, mixed precision
    "prune": 118,
    "distill": 135,
    "calibrate": 45,
    "eval": 65,
    "fallback-scan": 70,
    "generate": 35,
    "bench": 45,
    "run": 35,
    "recipe": 15,
    "recipe check": 15,
    "recipe show": 15,
    "batch": 45,
    "models": 15,
    "verify": 35,
}


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if path:
        yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


ROOT = typer.main.get_command(app)
COMMANDS = dict(_commands(ROOT))
LEAVES = sorted(path for path, command in COMMANDS.items() if not hasattr(command, "commands"))


@pytest.fixture(autouse=True)
def _terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDTH))


def _help(*path: str) -> str:
    """`llmq PATH --help` as a terminal of WIDTH columns shows it (CliRunner would force 80
    columns of text, where Click leaves a margin of 2)."""
    command, ctx = ROOT, ROOT.context_class(ROOT, info_name="llmq")
    for name in path:
        command = command.commands[name]
        ctx = command.context_class(command, info_name=name, parent=ctx)
    return command.get_help(ctx)


def test_every_command_has_a_budget() -> None:
    assert {" ".join(path) for path in COMMANDS} == set(BUDGETS)


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_help_fits_80_columns(path: tuple[str, ...]) -> None:
    text = _help(*path)
    lines = text.splitlines()
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, "\n".join(too_wide)
    assert len(lines) <= BUDGETS[" ".join(path)], text
    usage = text.split("\n\n", 1)[0]
    assert "{" not in usage, usage
    # cut names, Rich's types, markdown, the wrapping's non-breaking stand-ins
    for unwanted in ("…", "<bool>", "<str>", "`", "**", "\u00a0", "\u2011"):
        assert unwanted not in text, f"{unwanted!r} in:\n{text}"


@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_help_names_every_option_in_full(path: tuple[str, ...]) -> None:
    text = _help(*path)
    for param in COMMANDS[path].params:
        if param.param_type_name != "option" or param.hidden:
            continue
        names = [name for name in param.opts if name not in old_spellings(param)]
        if param.secondary_opts and param.default is not False:  # `--no-x` of a flag on by default
            names += param.secondary_opts
        for name in names:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} in:\n{text}"


@pytest.mark.parametrize(
    ("path", "option"),
    [(("quantize",), "--sparsity"), (("quantize",), "--pattern"), (("prune",), "--sparsity"),
     (("prune",), "--pattern"), (("distill",), "--sparsity"), (("distill",), "--pattern")],
)  # fmt: skip
def test_sparsity_and_pattern_say_not_both(path: tuple[str, ...], option: str) -> None:
    (param,) = [p for p in COMMANDS[path].params if option in p.opts]
    assert "(not both)" in param.help


GROUPS = [(), *sorted(set(COMMANDS) - set(LEAVES))]


@pytest.mark.parametrize("path", GROUPS, ids=lambda path: " ".join(("llmq", *path)))
def test_group_help_lists_every_command_on_one_line(path: tuple[str, ...]) -> None:
    """`llmq --help` (and `llmq recipe --help`): each command's first sentence, not cut."""
    text = _help(*path)
    assert all(len(line) <= WIDTH for line in text.splitlines()), text
    listed = dict(re.findall(r"^  (\S+) +(\S.*)$", text.split("Commands:", 1)[1], re.M))
    assert set(listed) == set((COMMANDS[path] if path else ROOT).commands)
    for name, summary in listed.items():
        assert not summary.endswith("..."), f"{name}: {summary}"
