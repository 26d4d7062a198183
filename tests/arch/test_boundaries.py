"""Module boundaries from the house style, checked on the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "llmq"

# package -> llmq packages (or third-party modules) it must not import
FORBIDDEN = {
    "quant": ("llmq.io", "llmq.calib", "llmq.cli", "llmq.pipeline", "llmq.eval", "llmq.pack"),
    "pack": ("llmq.cli", "llmq.calib", "llmq.pipeline", "llmq.eval"),
    "io": ("llmq.quant", "llmq.calib", "llmq.pipeline", "llmq.cli", "llmq.eval"),
    "calib": ("llmq.pipeline", "llmq.cli", "llmq.eval", "llmq.quant.rtn", "llmq.quant.methods"),
    "eval": ("llmq.pipeline", "llmq.cli", "llmq.quant.rtn", "llmq.quant.methods"),
    "pipeline": ("llmq.cli",),
    "fallback": ("llmq.calib", "llmq.cli", "llmq.pipeline", "llmq.eval", "llmq.pack"),
    # kernels read the packed layout and nothing else of llmq
    "kernels": (
        "llmq.io",
        "llmq.calib",
        "llmq.cli",
        "llmq.pipeline",
        "llmq.eval",
        "llmq.quant",
        "llmq.runtime",
        "llmq.fallback",
        "llmq.pack.format",
        "llmq.pack.reader",
        "llmq.api",
    ),
    "runtime": ("llmq.cli", "llmq.pipeline", "llmq.api"),
}
LIBRARY_BANS = ("typer", "rich")


def imported_modules(path: Path) -> set[str]:
    """Modules imported at run time (imports under `if TYPE_CHECKING:` are for annotations)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def library_files() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if "cli" not in p.relative_to(ROOT).parts]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_respect_their_boundaries(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        for module in imported_modules(path):
            banned = [b for b in FORBIDDEN[package] if module == b or module.startswith(b + ".")]
            assert not banned, f"{path.relative_to(ROOT)} imports {module}"


def test_only_the_cli_uses_typer_and_rich() -> None:
    for path in library_files():
        for module in imported_modules(path):
            assert module.split(".")[0] not in LIBRARY_BANS, f"{path} imports {module}"


def test_config_does_not_import_torch() -> None:
    for path in (ROOT / "config").glob("*.py"):
        assert not any(m.split(".")[0] == "torch" for m in imported_modules(path)), path
