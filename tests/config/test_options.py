"""One option set per job: the CLI's flags, a recipe file's stage and Python's keywords build the
same options, so the same job records the same recipe in llmq.json whichever way it is asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import llmq
from llmq.api.chain import run
from llmq.cli.main import app
from llmq.config import PruneOptions, QuantizeOptions, StructuredOptions
from llmq.errors import InputError

runner = CliRunner()
SMALL = {"num_samples": 2, "seq_len": 64}

JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (the stage kind and the CLI command, its options by their Python names)
    "quantize": (
        "quantize",
        {
            "scheme": "w4a16",
            "method": "gptq",
            "group_size": 64,
            "ignore": ["mlp.down_proj"],
            "dampening_frac": 0.02,
            **SMALL,
        },
    ),
    "prune": ("prune", {"method": "wanda", "sparsity": 0.5, "true_sequential": False, **SMALL}),
    "structured": (
        "prune",
        {
            "structured": True,
            "intermediate_size": 256,
            "depth_metric": "block",
            "evaluate": False,
            **SMALL,
        },
    ),
}


def cli_args(options: dict[str, Any]) -> list[str]:
    args = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append(f"--no-{name.replace('_', '-')}")
        elif isinstance(value, list):
            args += [part for item in value for part in (flag, str(item))]
        else:
            args += [flag, str(value)]
    return args


def recorded(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "llmq.json").read_text())["recipe"]


@pytest.mark.parametrize("job", sorted(JOBS))
def test_cli_yaml_and_python_record_the_same_recipe(
    job: str, tmp_path: Path, tiny_llama: Path
) -> None:
    kind, options = JOBS[job]
    cli_out = tmp_path / "cli"
    result = runner.invoke(app, [kind, str(tiny_llama), "--out", str(cli_out), "--no-reference", *cli_args(options)])  # fmt: skip
    assert result.exit_code == 0, result.output
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"stages": [{kind: options}]}))  # JSON is YAML
    run(recipe, tiny_llama, tmp_path / "yaml")
    python_out = tmp_path / "python"
    keywords = {k: v for k, v in options.items() if k != "structured"}
    if job == "structured":
        llmq.prune_structured(tiny_llama, python_out, reference=False, **keywords)
    else:
        getattr(llmq, kind)(tiny_llama, python_out, reference=False, **keywords)
    expected = recorded(cli_out)
    assert recorded(tmp_path / "yaml" / f"1-{kind}") == expected
    assert recorded(python_out) == expected


def test_prune_records_its_own_column_order_however_asked() -> None:
    """Python's `prune` recorded actorder static where the CLI recorded none."""
    assert PruneOptions.of(sparsity=0.5).recipe().gptq.actorder == "none"
    assert llmq.make_recipe(method="sparsegpt", sparsity=0.5).gptq.actorder == "static"


def test_lm_head_is_kept_whatever_else_is_ignored() -> None:
    assert QuantizeOptions.of(ignore=["mlp.down_proj"]).recipe().ignore == ("lm_head", "mlp.down_proj")  # fmt: skip
    assert QuantizeOptions.of(ignore=["lm_head"]).recipe().ignore == ("lm_head",)


@pytest.mark.parametrize(
    ("kind", "values", "fragment"),
    [
        (QuantizeOptions, {"schem": "w4a16"}, "schem: unknown option"),
        (QuantizeOptions, {"method": "foo"}, "unknown method 'foo'"),
        (
            QuantizeOptions,
            {"num_samples": 0},
            "num_samples: Input should be greater than or equal to 1",
        ),
        (PruneOptions, {"scheme": "w4a16", "sparsity": 0.5}, "scheme: prune quantizes nothing"),
        (PruneOptions, {"method": "gptq", "sparsity": 0.5}, "unknown method 'gptq' for prune"),
        (StructuredOptions, {"params": 1.5}, "params: Input should be less than 1"),
        (
            StructuredOptions,
            {"depth_metric": "loss"},
            "depth_metric: Input should be 'block' or 'ppl'",
        ),
    ],
)
def test_a_bad_option_is_one_line_naming_it(kind: Any, values: dict[str, Any], fragment: str) -> None:  # fmt: skip
    with pytest.raises(InputError) as refused:
        options = kind.of(**values)
        if hasattr(options, "recipe"):
            options.recipe()
    assert fragment in refused.value.message
