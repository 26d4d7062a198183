"""Recipes: every example validates, round-trips through YAML and runs on a tiny model; errors
name file, line and key; a failed gate stops the chain with exit 1; resume skips finished stages."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmq.api.chain import check_recipe, run
from llmq.cli.main import app
from llmq.errors import InputError
from llmq.recipes.load import dump_recipe, effective, load_recipe, parse_recipe
from llmq.recipes.schema import ChainRecipe
from tests.conftest import assert_bad_input, make_tiny, sharpen

runner = CliRunner()
EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
# A task gate runs lm-eval, which starts `python -m pip list` for its environment report.
EXAMPLES_MARKED = [
    pytest.param(path, marks=pytest.mark.process) if "tasks:" in path.read_text() else path
    for path in EXAMPLES
]
# What makes a stage quick on a tiny model: few, short windows and steps.
SMALL = {
    "quantize": {"num_samples": 4, "seq_len": 64},
    "prune": {"num_samples": 4, "seq_len": 64},
    "distill": {
        "max_steps": 2,
        "seq_len": 64,
        "grad_accum": 2,
        "eval_windows": 1,
        "eval_seq_len": 64,
        "warmup_steps": 0,
    },
    "eval": {"eval_windows": 2, "seq_len": 64, "limit": 4},
}


def small(recipe: ChainRecipe) -> ChainRecipe:
    """The same recipe with SMALL's sizes."""
    stages = [{kind: {**options, **SMALL[kind]}} for entry in effective(recipe)["stages"] for kind, options in entry.items()]  # fmt: skip
    return ChainRecipe.model_validate({"stages": stages})


def test_there_are_examples_for_every_stage_kind() -> None:
    kinds = {entry.kind for path in EXAMPLES for entry in load_recipe(path).recipe.stages}
    assert kinds == {"quantize", "prune", "distill", "eval"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_round_trips_through_yaml(path: Path) -> None:
    recipe = check_recipe(path).recipe
    again = parse_recipe(yaml.safe_load(dump_recipe(recipe))).recipe
    assert again == recipe
    assert dump_recipe(again) == dump_recipe(recipe)


@pytest.mark.parametrize("path", EXAMPLES_MARKED, ids=lambda p: p.stem)
def test_each_example_runs_on_a_tiny_model(tmp_path: Path, tiny_llama: Path, path: Path) -> None:
    recipe = small(load_recipe(path).recipe)
    result = run(recipe, tiny_llama, tmp_path / "out")
    gates = [s for s in result.stages if s.kind == "eval"]
    for gate in gates:
        if "tasks" in gate.summary:  # each gate fails only on a significant drop past it
            verdicts = [g for row in gate.summary["tasks"] for g in row["gates"]]
            assert all(g["passed"] == (not (g["beyond"] and g["significant"])) for g in verdicts)
            assert gate.passed == all(g["passed"] for g in verdicts)
            continue
        threshold = gate.summary["max_ppl_increase"]
        assert gate.passed == (threshold is None or gate.summary["increase"] <= threshold)
    ran = len(result.stages)
    assert ran == len(recipe.stages) or result.stages[-1].passed is False
    for stage in result.stages:
        assert Path(stage.output).exists(), stage.name
    assert (tmp_path / "out" / "llmq-run.json").is_file()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "stages:\n  - quantize:\n      scheme: w4a16\n      group_sise: 64\n",
            "recipe.yaml:4: stages[0].quantize.group_sise: unknown key 'group_sise'",
        ),
        (
            "stages:\n  - quantize:\n      seq_len: many\n",
            "recipe.yaml:3: stages[0].quantize.seq_len: Input should be a valid integer",
        ),
        (
            "stages:\n  - quantize:\n      scheme: w4a16\n      group_size: 100\n",
            "recipe.yaml:2: stages[0].quantize: group_size 100",
        ),
        (
            "stages:\n  - prune:\n      sparsity: 0.5\n  - eval:\n      baseline: distill\n  - distill:\n      max_steps: 3\n",
            "recipe.yaml:4: stages[1]: stage eval compares with distill, which runs later",
        ),
        (
            "stages:\n  - quantise: {}\n",
            "recipe.yaml:2: stages[0].quantise: unknown stage kind 'quantise'",
        ),
        (
            "stages:\n  - distill:\n      lr: 0.1\n",
            "recipe.yaml:2: stages[0].distill: how long to train",
        ),
        (
            "stages:\n  - prune:\n      params: 0.5\n",
            "stages[0].prune: params goes with structured: true",
        ),
        ("stages: []\n", "recipe.yaml:1: stages: List should have at least 1 item"),
        (
            "stages:\n  - eval:\n      max_drop: 0.02\n",
            "recipe.yaml:2: stages[0].eval: max_drop and min_recovery gate task accuracy",
        ),
        (
            "stages:\n  - quantize: {}\n  - eval: {}\n  - distill:\n      max_steps: 2\n",
            "recipe.yaml:4: stages[2]: stage distill trains a float model, but quantize before it",
        ),
        ("stages:\n  - quantize:\n    scheme: [w4a16\n", "recipe.yaml:4: not valid YAML"),
    ],
)
def test_recipe_errors_name_file_line_and_key(tmp_path: Path, text: str, fragment: str) -> None:
    result = runner.invoke(app, ["recipe", "check", str(write(tmp_path, text))])
    assert_bad_input(result, fragment)


def test_a_failed_gate_stops_the_chain_with_exit_1(tmp_path: Path, default_model: Path) -> None:
    model = sharpen(make_tiny(tmp_path / "model", default_model))
    path = write(tmp_path, "stages:\n  - prune:\n      method: magnitude\n      sparsity: 0.9\n"
                 "  - eval:\n      max_ppl_increase: 0.01\n      eval_windows: 1\n      seq_len: 64\n"
                 "  - quantize:\n      scheme: w8a16\n")  # fmt: skip
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(path), "--model", str(model), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output
    assert (out / "1-prune").is_dir() and (out / "2-eval.json").is_file()
    assert not (out / "3-quantize").exists()


class StopAt:
    """A progress sink that raises KeyboardInterrupt when a given stage starts."""

    def __init__(self, name: str) -> None:
        self.name = name

    @contextmanager
    def stage(self, description: str, total: int | None = None, *, transient: bool = False):
        if description == f"stage {self.name}":
            raise KeyboardInterrupt
        yield lambda steps=1, status=None: None


def test_resume_skips_finished_stages_and_refuses_another_recipe(
    tmp_path: Path, tiny_llama: Path
) -> None:
    text = "stages:\n  - prune:\n      method: magnitude\n      sparsity: 0.5\n      num_samples: 1\n  - quantize:\n      scheme: w8a16\n      num_samples: 1\n"  # fmt: skip
    recipe, out = load_recipe(write(tmp_path, text)), tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run(recipe, tiny_llama, out, progress=StopAt("quantize"))
    first = out / "1-prune" / "llmq.json"
    stamp = first.stat().st_mtime_ns
    result = run(recipe, tiny_llama, out, resume=True)
    assert [(s.name, s.resumed) for s in result.stages] == [("prune", True), ("quantize", False)]
    assert first.stat().st_mtime_ns == stamp  # not redone
    other = parse_recipe({"stages": [{"quantize": {"scheme": "w4a16"}}]})
    with pytest.raises(InputError, match="another recipe or model"):
        run(other, tiny_llama, out, resume=True)
    with pytest.raises(InputError, match="exists"):
        run(recipe, tiny_llama, out)


def test_resume_of_a_run_killed_before_its_record_was_written_starts_over(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """A kill while the run's record was first written leaves only its partial file (found by
    a killed `llmq batch` worker): --resume starts from the first stage, leftover removed; a
    folder holding anything else is still refused."""
    text = "stages:\n  - quantize:\n      scheme: w8a16\n      num_samples: 1\n"
    recipe, out = load_recipe(write(tmp_path, text)), tmp_path / "out"
    out.mkdir()
    leftover = out / ".llmq-run.json.32573-e635e9be.partial"
    leftover.write_text('{"model": ')
    result = run(recipe, tiny_llama, out, resume=True)
    assert [(s.name, s.resumed) for s in result.stages] == [("quantize", False)]
    assert not leftover.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(InputError, match="holds no interrupted"):
        run(recipe, tiny_llama, mine, resume=True)
    assert (mine / "notes.txt").read_text() == "the user's"


def test_recipe_keys_take_percentages_and_the_old_spellings() -> None:
    """A share is a fraction or a percentage in a recipe as on the command line; the eval and
    distill keys renamed with their flags (`text`, `max_windows`, `data`) still read."""
    from llmq.recipes.schema import ChainRecipe

    stages = ChainRecipe.model_validate({"stages": [
        {"prune": {"sparsity": "50%"}},
        {"distill": {"max_steps": 3, "gmp": {"sparsity": "40%"}, "min_lr_ratio": "5%", "data": "pydoc"}},
        {"eval": {"max_ppl_increase": "3%", "text": "news", "max_windows": 3}},
    ]}).stages  # fmt: skip
    prune, distill, gate = (entry.stage for entry in stages)
    assert prune.sparsity == 0.5 and distill.gmp.sparsity == 0.4 and distill.min_lr_ratio == 0.05
    assert distill.train_text == "pydoc" and gate.eval_text == "news" and gate.eval_windows == 3
    assert gate.max_ppl_increase == 0.03
    with pytest.raises(ValueError, match="expected a percentage like 3%"):
        ChainRecipe.model_validate({"stages": [{"prune": {"sparsity": "5x%"}}]})
