"""`--help` that reads well at 80 columns and in a log: options grouped into sections (each
option's `rich_help_panel`), `--out OUT` instead of a type in angle brackets, usage with the
arguments' names as they are typed. Old spellings of renamed options (llmq.cli.options.renamed)
are left out of it, and warn when used; a value an option's parser refuses is one `error:` line.

Typer's Rich help lays every option out in six columns, which at 80 columns cuts option names
and squeezes each help text to a word a line. Plain Click formatting wraps the help under the
option instead; this command class adds the sections. Option help is one short sentence; the
details are in docs/.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from typer.core import TyperCommand

from llmq.cli.console import cli_errors, err_console, labelled
from llmq.cli.options import RENAMED, old_spellings

OPTIONS = "Options"  # the section of an option that names none
COLUMN = 26  # the widest option names beside their help; wider ones get a line of their own
_NB_HYPHEN, _NB_SPACE = "\u2011", "\u00a0"  # held while the text wraps, then plain again


# Typer carries its own copy of Click: build on its classes, not on the click package's.
_ClickContext = TyperCommand.context_class


class HelpFormatter(_ClickContext.formatter_class):
    """Click's formatter, but a line never breaks after a hyphen (`--resume-every` and
    `per-channel` stay whole) nor inside `[default: 512]`."""

    def write_text(self, text: str) -> None:
        with self._whole_words():
            super().write_text(text.replace("-", _NB_HYPHEN))

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = [(term, text.replace("-", _NB_HYPHEN)) for term, text in rows]
        with self._whole_words():
            super().write_dl(rows, col_max, col_spacing)

    @contextmanager
    def _whole_words(self) -> Iterator[None]:
        start = len(self.buffer)
        yield
        plain = {ord(_NB_HYPHEN): "-", ord(_NB_SPACE): " "}
        self.buffer[start:] = [text.translate(plain) for text in self.buffer[start:]]


class _Context(_ClickContext):
    formatter_class = HelpFormatter


class LlmqCommand(TyperCommand):
    """A Typer command whose help groups its options into sections, in order of first use."""

    context_class = _Context

    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        """Click's, where an InputError from an option's parser (a bad `--sparsity 50x`) is
        one `error:` line and exit 2, as it would be from the command."""
        with cli_errors():
            return super().make_context(info_name, args, parent, **extra)

    def make_parser(self, ctx: Any) -> Any:
        """Click's parser, where each old spelling of a renamed option warns before it parses
        as the new one (once per command line)."""
        parser = super().make_parser(ctx)
        for name, option in list(parser._long_opt.items()):  # Click has no public hook for this
            if name in old_spellings(option.obj):
                parser._long_opt[name] = _OldSpelling(option, name, ctx)
        return parser

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = _argument_name(param)
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for title, record in _records(self, ctx):
            sections.setdefault(title, []).append(record)
        # one column for the help texts in every section: names padded to the widest that fits
        width = min(max((len(name) for name, _ in _flat(sections)), default=0), COLUMN)
        for title, records in sections.items():
            with formatter.section(title):
                formatter.write_dl([(name.ljust(width), text) for name, text in records], COLUMN)


class _OldSpelling:
    """A parser entry for an old spelling: warns, then is the option it names."""

    def __init__(self, option: Any, name: str, ctx: Any) -> None:
        self._option, self._name, self._ctx = option, name, ctx

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._option, attribute)

    def process(self, value: Any, state: Any) -> None:
        warned = self._ctx.meta.setdefault("llmq.old_spellings", set())
        if self._name not in warned:
            warned.add(self._name)
            message = f"{self._name} is now {RENAMED[self._name]}"
            err_console.print(labelled("warning:", "bold yellow", message), soft_wrap=True)
        self._option.process(value, state)


def _flat(sections: dict[str, list[tuple[str, str]]]) -> Iterator[tuple[str, str]]:
    return (record for records in sections.values() for record in records)


def _records(command: TyperCommand, ctx: Any) -> Iterator[tuple[str, tuple[str, str]]]:
    """(section, (names, help)) of each visible parameter: arguments first, then options."""
    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    for param in params:
        if param.param_type_name == "argument":
            yield "Arguments", (_argument_name(param), param.help or "")
    for param in params:
        if param.param_type_name == "option":
            section = getattr(param, "rich_help_panel", None) or OPTIONS
            yield section, (_option_names(param), _option_help(param))


def _argument_name(param: Any) -> str:
    name = (param.metavar or param.name).upper()
    return f"{name}..." if param.nargs != 1 else name


def _option_names(param: Any) -> str:
    """`-o, --out OUT`, `--overwrite`, `--true-sequential / --no-true-sequential`: a flag that
    is off by default shows only its positive name (its `--no-` form is the default anyway)."""
    old = old_spellings(param)
    names = ", ".join(sorted((name for name in param.opts if name not in old), key=len))
    if param.secondary_opts and param.default is not False:
        names += " / " + ", ".join(param.secondary_opts)
    if not param.is_flag:
        names += f" {param.metavar or param.name.upper()}"
    return names


def _option_help(param: Any) -> str:
    """The help sentence, then the default where there is one worth saying."""
    text = param.help or ""
    default = param.default
    if param.required:
        return f"{text}  [required]".strip()
    if param.is_flag:
        return f"{text}  [default:{_NB_SPACE}on]".strip() if default is True and param.secondary_opts else text  # fmt: skip
    if default is None or default == [] or default == () or callable(default):
        return text
    return f"{text}  [default:{_NB_SPACE}{default}]".strip()
