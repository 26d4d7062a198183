"""One vocabulary across commands (docs/cli.md): a renamed flag's old spelling still works,
hidden from --help, with one `warning:` line; a share is 0.5 or 50% wherever it is taken; a bad
one is one `error:` line (exit 2).

The commands run up to the API call, which records what it was given instead of working."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import BaseModel
from typer.testing import CliRunner

from llmq.cli.main import app
from llmq.cli.options import RENAMED, old_spellings
from llmq.config.fraction import EXPECTED, Fraction, parse_fraction

runner = CliRunner()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
ROOT = typer.main.get_command(app)


class Called(Exception):
    """What a command handed to the API: raised by the stand-in, so nothing runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__("called")
        self.args_, self.kwargs = args, kwargs


def _record(*args: Any, **kwargs: Any) -> None:
    raise Called(*args, **kwargs)


@pytest.fixture(autouse=True)
def _api(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmq import api
    from llmq.api import tasks

    for name in ("quantize", "prune", "prune_structured", "distill", "evaluate", "verify", "fallback_scan", "bench"):  # fmt: skip
        monkeypatch.setattr(api, name, _record)
    monkeypatch.setattr(tasks, "evaluate_tasks", _record)


def same(a: Called, b: Called) -> bool:
    """The same call, but for the progress display (a new one each time)."""
    a_kwargs = {k: v for k, v in a.kwargs.items() if k != "progress"}
    return (a.args_, a_kwargs) == (b.args_, {k: v for k, v in b.kwargs.items() if k != "progress"})


def call(*args: str) -> tuple[Called, str]:
    """The API call the command line makes, and what the command printed on stderr."""
    result = runner.invoke(app, list(args))
    assert isinstance(result.exception, Called), result.output
    return result.exception, result.stderr


# command line with the new spelling, the old one in its place
RENAMES = [
    (["eval", "m", "--eval-text", "pydoc"], "--text"),
    (["eval", "m", "--eval-windows", "3"], "--max-windows"),
    (["verify", "m", "--baseline", "base"], "--against"),
    (["verify", "m", "--loader", "transformers,llmq"], "--loaders"),
    (["fallback-scan", "m", "--jobs", "3"], "--workers"),
    (["bench", "--batch-size", "1,16"], "--batch"),
    (["distill", "--train-text", "pydoc", "--teacher", "t", "--student", "s", "-o", "o"], "--data"),
]


@pytest.mark.parametrize(("line", "old"), RENAMES, ids=[old for _, old in RENAMES])
def test_old_spelling_works_and_warns_once(line: list[str], old: str) -> None:
    new = RENAMED[old]
    assert new in line
    expected, quiet = call(*line)
    assert quiet == ""  # the new spelling says nothing
    as_before, warned = call(*[old if word == new else word for word in line])
    assert same(as_before, expected)
    assert warned.splitlines() == [f"warning: {old} is now {new}"]


def test_old_spelling_warns_once_however_often_given() -> None:
    called, warned = call("verify", "m", "--loaders", "vllm", "--loaders", "llmq", "--against", "b")
    assert called.kwargs["loaders"] == ["vllm", "llmq"] and called.kwargs["against"] == "b"
    assert warned.splitlines() == ["warning: --loaders is now --loader", "warning: --against is now --baseline"]  # fmt: skip


def test_old_spelling_with_equals_sign() -> None:
    called, warned = call("eval", "m", "--text=pydoc")
    assert called.kwargs["text"] == "pydoc"
    assert warned.splitlines() == ["warning: --text is now --eval-text"]


def _commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = [(path, command)] if path else []
    for name, sub in getattr(command, "commands", {}).items():
        found += _commands(sub, (*path, name))
    return found


def test_old_spellings_are_hidden_from_help() -> None:
    seen = set()
    for path, command in _commands(ROOT):
        params = [p for p in command.params if p.param_type_name == "option"]
        olds = {name for param in params for name in old_spellings(param)}
        if not olds:
            continue
        seen |= olds
        text = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"}).output
        for old in olds:
            assert not re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", text), (path, old)
            assert RENAMED[old] in text
    assert seen == {old for _, old in RENAMES}


def test_docs_list_every_rename() -> None:
    """docs/cli.md's table of old spellings names each one with what it is now."""
    docs = DOCS.read_text()
    for old, new in RENAMED.items():
        assert re.search(rf"`{re.escape(old)}`[^\n]*`{re.escape(new)}", docs), old


def test_lists_take_commas_or_repeats() -> None:
    commas, _ = call("verify", "m", "--loader", "transformers, llmq")
    repeated, _ = call("verify", "m", "--loader", "transformers", "--loader", "llmq")
    assert commas.kwargs["loaders"] == repeated.kwargs["loaders"] == ["transformers", "llmq"]
    commas, _ = call("bench", "--batch-size", "1,16", "--shapes", "1x64x64,2x64x64")
    repeated, _ = call("bench", "--batch-size", "1", "--batch-size", "16", "--shapes", "1x64x64", "--shapes", "2x64x64")  # fmt: skip
    assert same(commas, repeated)
    assert commas.kwargs["batch_sizes"] == [1, 16]
    commas, _ = call("eval", "m", "--tasks", "hamlet_cloze,hamlet_next_line")
    repeated, _ = call("eval", "m", "--tasks", "hamlet_cloze", "--tasks", "hamlet_next_line")
    assert commas.args_[1] == repeated.args_[1] == ["hamlet_cloze", "hamlet_next_line"]


# --- fractions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("3%", 0.03), ("50%", 0.5), ("0.1%", 0.001), ("12.5%", 0.125), (" 7 %", 0.07),
     ("100%", 1.0), ("0%", 0.0), ("0.03", 0.03), ("1e-3", 0.001), (0.25, 0.25), (1, 1.0)],
)  # fmt: skip
def test_percent_is_the_fraction(text: str | float, value: float) -> None:
    assert parse_fraction(text) == value  # the same float, not merely close


@pytest.mark.parametrize("text", ["", "%", "3%%", "abc", "3 percent", "nan", "inf", "-inf%", True])
def test_not_a_fraction(text: str | bool) -> None:
    with pytest.raises(ValueError, match=re.escape(EXPECTED)):
        parse_fraction(text)


def test_config_fields_take_percentages() -> None:
    class Gate(BaseModel):
        share: Fraction

    assert Gate(share="2%").share == Gate(share=0.02).share == 0.02
    with pytest.raises(ValueError, match="expected a percentage"):
        Gate(share="2x")


Q, P, E, S = ["quantize", "m", "-o", "o"], ["prune", "m", "-o", "o"], ["eval", "m"], ["fallback-scan", "m"]  # fmt: skip
# (command line up to the option, option, as a percentage, as a fraction, where the value lands)
FRACTIONS = [
    ([*Q, "--method", "wanda"], "--sparsity", "50%", "0.5", "sparsity"),
    ([*Q, "--method", "gptq"], "--dampening-frac", "1%", "0.01", "dampening_frac"),
    ([*Q, "--scheme", "w8a8"], "--smooth", "50%", "0.5", "smooth"),
    ([*Q, "--fallback", "auto"], "--fallback-threshold", "5%", "0.05", "fallback_threshold"),
    (P, "--sparsity", "50%", "0.5", "sparsity"),
    ([*P, "--structured"], "--params", "75%", "0.75", "params"),
    ([*P, "--structured"], "--decoder-params", "75%", "0.75", "decoder_params"),
    ([*E, "--baseline", "b"], "--max-ppl-increase", "3%", "0.03", "max_ppl_increase"),
    ([*E, "--tasks", "t", "--max-drop", "2%"], "--confidence", "90%", "0.9", "confidence"),
    ([*E, "--tasks", "t"], "--max-drop", "2%", "0.02", "max_drop"),
    ([*E, "--tasks", "t"], "--min-recovery", "t=95%", "t=0.95", "min_recovery"),
    (S, "--nrmse-threshold", "5%", "0.05", "nrmse_threshold"),
    ([*S, "--calib-stats", "s"], "--error-share-threshold", "5%", "0.05", "error_share_threshold"),
]


def _landed(called: Called, field: str) -> Any:
    if field in called.kwargs:
        return called.kwargs[field]
    options = called.args_[2]  # quantize and prune: (model, out, options)
    return getattr(options, field)


@pytest.mark.parametrize(
    ("line", "option", "percent", "number", "field"), FRACTIONS, ids=[f[1] for f in FRACTIONS]
)
def test_percent_strings_parse_as_fractions(
    line: list[str], option: str, percent: str, number: str, field: str
) -> None:
    as_percent, _ = call(*line, option, percent)
    as_fraction, _ = call(*line, option, number)
    assert _landed(as_percent, field) == _landed(as_fraction, field)
    assert same(as_percent, as_fraction)


@pytest.mark.parametrize(
    ("line", "option", "percent", "number", "field"), FRACTIONS, ids=[f[1] for f in FRACTIONS]
)
def test_bad_fraction_is_one_error_line(
    line: list[str], option: str, percent: str, number: str, field: str
) -> None:
    bad = percent.replace("%", "x%")  # a percentage that is not one
    result = runner.invoke(app, [*line, option, bad])
    assert result.exit_code == 2, result.output
    (only,) = result.output.strip().splitlines()
    assert only.startswith(f"error: {option} ") and "expected" in only, only
