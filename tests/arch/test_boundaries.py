"""Module boundaries from the house style, checked on the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "llmq"

# Every package and top-level module of llmq -> the llmq packages (or modules) it may import;
# anything else is a back-import and fails. Layers, bottom up: errors, progress, texts, models,
# config and recipes (no torch); io; quant (primitives and methods' math); calib, pack, fallback,
# pruning, kernels, runtime, eval; pipeline, distillation; api; batch and cli, its clients.
# `llmq` itself: its __version__ (the package imports nothing until an API name is used)
BASE = ("llmq", "llmq.errors", "llmq.progress")
# fmt: off
ALLOWED: dict[str, tuple[str, ...]] = {
    "errors": (),
    "progress": (),
    "packaged": BASE,
    "heap": BASE,
    "cpu": BASE,
    # torchrun's processes: data-parallel calibration and training
    "processes": BASE,
    "texts": (*BASE, "llmq.packaged"),
    "models": (*BASE, "llmq.packaged"),
    "config": (*BASE, "llmq.texts"),
    "recipes": (*BASE, "llmq.texts", "llmq.config"),
    "io": BASE,
    "quant": (*BASE, "llmq.config"),
    # GGUF export: its block layouts and grids, the checkpoint, a calibration pass for the
    # importance matrix, and mixed precision's solver for types to a budget
    "gguf": (*BASE, "llmq.config", "llmq.io", "llmq.quant", "llmq.calib", "llmq.mixed"),
    "pack": (*BASE, "llmq.config", "llmq.io", "llmq.quant"),
    # kernels read the packed layout and nothing else of llmq
    "kernels": (*BASE, "llmq.pack.layout"),
    "calib": (
        *BASE,
        "llmq.processes",
        "llmq.texts",
        "llmq.models",
        "llmq.heap",
        "llmq.config",
        "llmq.io",
        "llmq.quant",
    ),
    # data-free by design: no calibration
    "fallback": (*BASE, "llmq.heap", "llmq.cpu", "llmq.config", "llmq.io", "llmq.quant"),
    "pruning": (*BASE, "llmq.heap", "llmq.config", "llmq.io", "llmq.quant", "llmq.calib"),
    "runtime": (
        *BASE,
        "llmq.config",
        "llmq.io",
        "llmq.quant",
        "llmq.calib",
        "llmq.pack",
        "llmq.kernels",
    ),
    "eval": (
        *BASE,
        "llmq.texts",
        "llmq.models",
        "llmq.heap",
        "llmq.config",
        "llmq.io",
        "llmq.calib",
        "llmq.pack",
        "llmq.runtime",
        "llmq.gguf",  # verify reads a GGUF file back as its source's tensors
    ),
    # mixed precision: measures the float model's linears (calib), counts packed bytes (pack)
    "mixed": (*BASE, "llmq.config", "llmq.io", "llmq.quant", "llmq.calib", "llmq.pack"),
    "pipeline": (
        *BASE,
        "llmq.mixed",
        "llmq.processes",
        "llmq",
        "llmq.texts",
        "llmq.heap",
        "llmq.cpu",
        "llmq.config",
        "llmq.io",
        "llmq.quant",
        "llmq.calib",
        "llmq.pack",
        "llmq.fallback",
        "llmq.pruning",
        "llmq.eval",
    ),
    # training never runs the public API: QAT's export is a pipeline job
    "distillation": (
        *BASE,
        "llmq.processes",
        "llmq",
        "llmq.texts",
        "llmq.config",
        "llmq.io",
        "llmq.quant",
        "llmq.calib",
        "llmq.pruning",
        "llmq.runtime",
        "llmq.pipeline",
    ),
    "api": (
        *BASE,
        "llmq.processes",
        "llmq",
        "llmq.texts",
        "llmq.models",
        "llmq.config",
        "llmq.recipes",
        "llmq.io",
        "llmq.quant",
        "llmq.calib",
        "llmq.pack",
        "llmq.fallback",
        "llmq.pruning",
        "llmq.runtime",
        "llmq.eval",
        "llmq.pipeline",
        "llmq.distillation",
        "llmq.gguf",
    ),
    # clients of the API, as the CLI is
    "batch": (
        *BASE,
        "llmq.models",
        "llmq.config",
        "llmq.recipes",
        "llmq.io",
        "llmq.calib",
        "llmq.api",
    ),
    "cli": (
        *BASE,
        "llmq.processes",
        "llmq",
        "llmq.texts",
        "llmq.config",
        "llmq.recipes",
        "llmq.io",
        "llmq.fallback",
        "llmq.api",
        "llmq.batch",
    ),
    "__init__": ("llmq", "llmq.api"),
    "__main__": ("llmq.cli",),
}
# fmt: on
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


def sources(package: str) -> list[Path]:
    folder = ROOT / package
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [ROOT / f"{package}.py"]


def llmq_imports(path: Path) -> set[str]:
    return {m for m in imported_modules(path) if m == "llmq" or m.startswith("llmq.")}


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def test_every_package_has_a_rule() -> None:
    found = {
        p.name
        for p in ROOT.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"
    }
    found = {name.removesuffix(".py") for name in found}
    assert found == set(ALLOWED), f"packages without a rule: {sorted(found - set(ALLOWED))}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_is_below_them(package: str) -> None:
    own = f"llmq.{package}"
    for path in sources(package):
        for module in llmq_imports(path):
            if module == own or module.startswith(own + "."):
                continue
            allowed = any(module == a or module.startswith(a + ".") for a in ALLOWED[package])
            assert allowed, f"{path.relative_to(ROOT)} imports {module}"


def test_no_import_cycle_between_packages() -> None:
    """Lazy imports inside functions count: a cycle is a cycle, whenever it is taken."""
    graph = {
        package: {package_of(m) for path in sources(package) for m in llmq_imports(path)}
        - {package}
        for package in ALLOWED
    }
    assert_acyclic(graph)


def test_only_the_cli_uses_typer_and_rich() -> None:
    for path in library_files():
        for module in imported_modules(path):
            assert module.split(".")[0] not in LIBRARY_BANS, f"{path} imports {module}"


def test_config_does_not_import_torch() -> None:
    for path in (ROOT / "config").glob("*.py"):
        assert not any(m.split(".")[0] == "torch" for m in imported_modules(path)), path


def module_graph() -> dict[str, set[str]]:
    """Each llmq module -> the llmq modules it imports (lazy ones too). The root package's lazy
    public names are left out: `from llmq import __version__` reaches nothing."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for module, names in imported_names(path):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            found.update(targets or [module])
        graph[name] = set() if name == "llmq" else (found & set(modules)) - {name}
    return graph


def imported_names(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) of each llmq import outside `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmq"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("llmq")]
    return found


def test_no_import_cycle_between_modules() -> None:
    """Inside a package too (api/chain -> api/distill -> api/iterative -> api/chain was one)."""
    assert_acyclic(module_graph())


def assert_acyclic(graph: dict[str, set[str]]) -> None:
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            assert node != start, f"{start} is imported back through {sorted(seen)}"
            if node not in seen:
                seen.add(node)
                todo += graph.get(node, ())
