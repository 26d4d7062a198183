"""Adversarial input, as a user on a fresh clone gives it: every command that writes refuses an
output over one of its inputs, --overwrite replaces only what llmq wrote, no input file's bytes
make a traceback, and a threshold that would gate nothing is refused. Each case asserts the exit
code, a single `error:` line and that every input is byte for byte (and mode for mode) what it
was. Refusals run through the CLI's app in this process (the entry point is `app()` and nothing
more; a real process only adds seconds of imports a case, and tests/cli/test_output_safety.py
refuses in real ones); what depends on the process itself (its umask, what lm-eval's child
processes print) runs in a real one."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmq.cli.main import app
from tests.cli.test_output_safety import llmq_cmd, one_error_line


def fingerprint(path: Path) -> dict[str, tuple[str, int]]:
    """Every file under `path` (or `path` itself): its SHA-256 and mode."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {
        str(p.relative_to(path.parent)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mode,
        )
        for p in files
    }


def refused(args: list[str], inputs: list[Path], *, code: int = 2) -> str:
    """Run `llmq ARGS`; assert it exits `code` with one `error:` line and that no input changed.
    Returns the error line."""
    before = {str(p): fingerprint(p) for p in inputs}
    run = CliRunner().invoke(app, args)
    assert run.exit_code == code, (args, run.output)
    line = one_error_line(run.stderr)
    assert "error:" not in run.stdout, run.stdout
    for path in inputs:
        assert path.exists(), f"{path} was deleted by {args}"
        assert fingerprint(path) == before[str(path)], f"{path} changed under {args}"
    return line


@pytest.fixture
def nested(tmp_path: Path, tiny_llama: Path) -> Path:
    """parent/model: a user's model inside a folder they might name as --out."""
    model = tmp_path / "parent" / "model"
    shutil.copytree(tiny_llama, model)
    (tmp_path / "parent" / "notes.txt").write_text("my notes\n")
    return model


@pytest.mark.parametrize("command", ["quantize", "prune", "prune-structured"])
def test_out_over_the_input_model_is_refused_and_the_model_is_kept(
    nested: Path, command: str
) -> None:
    parent = nested.parent
    base = {
        "quantize": ["quantize", "--scheme", "w8a16"],
        "prune": ["prune", "--method", "magnitude", "--sparsity", "0.5"],
        "prune-structured": ["prune", "--structured", "--intermediate-size", "256"],
    }[command]
    link = parent.parent / "link-to-parent"
    link.symlink_to(parent)
    for out, relation in (
        (parent, "would contain"),  # the reported case: the model deleted, exit 0
        (link, "would contain"),  # the same through a symbolic link
        (nested, "is the model"),
        (nested / "sub", "would be inside"),
        (nested / "sub" / "deeper", "would be inside"),
    ):
        line = refused([base[0], str(nested), "--out", str(out), "--overwrite", *base[1:]], [parent])  # fmt: skip
        assert relation in line, line
    assert not (nested / "sub").exists()
    assert sorted(p.name for p in parent.parent.iterdir()) == ["link-to-parent", "parent"]


def test_overwrite_replaces_only_a_folder_llmq_wrote(tmp_path: Path, tiny_llama: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.safetensors").write_bytes(b"another tool's output")
    (theirs / "README.md").write_text("notes\n")
    line = refused(["quantize", str(tiny_llama), "--out", str(theirs), "--overwrite", "--scheme", "w8a16"], [theirs])  # fmt: skip
    assert "not written by llmq" in line
    line = refused(["prune", str(tiny_llama), "--out", str(theirs), "--overwrite", "--structured", "--intermediate-size", "256"], [theirs])  # fmt: skip
    assert "not written by llmq" in line
    # An empty folder and an earlier llmq output are replaced.
    out = tmp_path / "out"
    out.mkdir()
    for _ in range(2):
        run = CliRunner().invoke(app, ["quantize", str(tiny_llama), "--out", str(out), "--overwrite", "--scheme", "w8a16", "--no-reference"])  # fmt: skip
        assert run.exit_code == 0, run.output
        assert (out / "llmq.json").is_file()


def test_calibrate_and_scan_never_write_into_their_inputs(tmp_path: Path, tiny_llama: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    text = tmp_path / "calib.txt"
    text.write_text("To be, or not to be, that is the question. " * 200)
    line = refused(["calibrate", str(model), "--out", str(model / "stats.safetensors")], [model])
    assert "would be inside the model" in line
    line = refused(["fallback-scan", str(model), "--report", str(model / "scan.json")], [model])
    assert "would be inside the scanned path" in line
    # --overwrite replaces an llmq statistics file only.
    other = tmp_path / "other.safetensors"
    shutil.copy(model / "model.safetensors", other)
    line = refused(["calibrate", str(model), "--out", str(other), "--overwrite", "--calib-text", str(text)], [other, text])  # fmt: skip
    assert "not a statistics file llmq wrote" in line


def test_run_and_distill_refuse_outputs_over_their_inputs(tmp_path: Path, tiny_llama: Path) -> None:
    work = tmp_path / "work"
    model = work / "model"
    shutil.copytree(tiny_llama, model)
    recipe = work / "recipe.yaml"
    recipe.write_text("stages:\n  - quantize:\n      scheme: w8a16\n")
    line = refused(["run", str(recipe), "--model", str(model), "--out", str(work), "--overwrite"], [work])  # fmt: skip
    assert "would contain" in line
    # A text the recipe reads, inside OUT.
    data = tmp_path / "runs" / "data.txt"
    data.parent.mkdir()
    data.write_text("Some training text. " * 500)
    recipe2 = tmp_path / "recipe2.yaml"
    recipe2.write_text(f"stages:\n  - quantize:\n      scheme: w8a16\n      calib_text: {data}\n")
    line = refused(["run", str(recipe2), "--model", str(model), "--out", str(data.parent), "--overwrite"], [data, recipe2])  # fmt: skip
    assert f"would contain the text {data}" in line
    # --resume never writes into a folder that holds no run.
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    line = refused(["run", str(recipe), "--model", str(model), "--out", str(notes), "--resume"], [notes])  # fmt: skip
    assert "no interrupted `llmq run`" in line
    line = refused(["distill", "--teacher", str(model), "--student", str(model), "--out", str(work), "--overwrite", "--max-steps", "1"], [work])  # fmt: skip
    assert "would contain the teacher" in line


@pytest.mark.parametrize("kind", ["recipe", "jobs"])
def test_files_of_any_bytes_are_one_line(tmp_path: Path, tiny_llama: Path, kind: str) -> None:
    for name, data in {
        "latin1.yaml": "stages:\n  - quantize:\n      scheme: w8a16  # caf\xe9\n".encode("latin-1"),
        "binary.yaml": bytes(range(256)),
        "nul.yaml": b"stages:\x00\n",
        "empty.yaml": b"",
        "list.yaml": b"- 1\n- 2\n",
    }.items():
        path = tmp_path / name
        path.write_bytes(data)
        if kind == "recipe":
            args = ["run", str(path), "--model", str(tiny_llama), "--out", str(tmp_path / "o")]
        else:
            args = ["batch", str(path), "--out", str(tmp_path / "o")]
        line = refused(args, [path])
        assert str(path) in line, line
    assert not (tmp_path / "o").exists()


def test_recipe_check_names_bad_bytes(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(b"stages:\n  - quantize:\n      scheme: \xff\xfe\n")
    line = refused(["recipe", "check", str(path)], [path])
    assert f"{path}:3: the recipe is not UTF-8 text" in line


def test_thresholds_that_gate_nothing_are_refused(tmp_path: Path, tiny_llama: Path) -> None:
    model = str(tiny_llama)
    for args, fragment in (
        (
            ["eval", model, "--baseline", model, "--max-drop", "0.05"],
            "--max-drop applies to task accuracy",
        ),
        (
            ["eval", model, "--baseline", model, "--min-recovery", "0.9"],
            "--min-recovery applies to task accuracy",
        ),
        (["eval", model, "--confidence", "0.9"], "--confidence applies to task accuracy"),
        (
            ["eval", model, "--tasks", "hamlet_next_line", "--confidence", "0.9"],
            "give --max-drop or --min-recovery",
        ),
        (["eval", model, "--max-ppl-increase", "3%"], "needs --baseline"),
        (["eval", model, "--tasks", "hamlet_next_line", "--max-drop", "0.05"], "give --baseline"),
        (["fallback-scan", model, "--error-share-threshold", "0.1"], "give --calib-stats"),
        (
            ["quantize", model, "--out", str(tmp_path / "q"), "--fallback-threshold", "0.1"],
            "use --fallback auto",
        ),
    ):
        assert fragment in refused(args, [tiny_llama]), args
    assert not (tmp_path / "q").exists()


@pytest.mark.process
def test_shards_are_written_with_the_users_umask(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "q"
    run = subprocess.run(
        [
            "sh",
            "-c",
            'umask 022 && exec "$@"',
            "sh",
            *llmq_cmd(
                "quantize",
                str(tiny_llama),
                "--out",
                str(out),
                "--scheme",
                "w8a16",
                "--no-reference",
            ),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes and set(modes.values()) == {0o644}, modes


def test_bad_options_and_recipes_say_what_to_use(tmp_path: Path, tiny_llama: Path) -> None:
    model = str(tiny_llama)
    unknown_kind = tmp_path / "kind.yaml"
    unknown_kind.write_text("stages:\n  - quantise:\n      scheme: w8a16\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("stages:\n  - quantize:\n      schem: w8a16\n")
    no_stages = tmp_path / "none.yaml"
    no_stages.write_text("name: mine\n")
    for args, fragment in (
        (
            ["prune", model, "--out", str(tmp_path / "p"), "--method", "foo", "--sparsity", "0.5"],
            "unknown method 'foo' for prune",
        ),
        (
            ["prune", model, "--out", str(tmp_path / "p"), "--method", "gptq", "--sparsity", "0.5"],
            "unknown method 'gptq' for prune",
        ),
        (
            ["prune", model, "--out", str(tmp_path / "p"), "--sparsity", "nan"],
            "--sparsity 'nan': expected a percentage",
        ),
        (
            ["recipe", "check", str(unknown_kind)],
            f"{unknown_kind}:2: stages[0].quantise: unknown stage kind 'quantise'",
        ),
        (
            ["recipe", "check", str(typo)],
            f"{typo}:3: stages[0].quantize.schem: unknown key 'schem'",
        ),
        (["recipe", "check", str(no_stages)], f"{no_stages}: stages: missing"),
    ):
        assert fragment in refused(args, [tiny_llama, tmp_path]), args


@pytest.mark.process
def test_task_gates_print_no_git_noise(tmp_path: Path, tiny_llama: Path) -> None:
    """lm-eval runs `git describe` in the current folder; outside a repository git's `fatal:`
    lines went straight to the user's terminal."""
    run = subprocess.run(
        llmq_cmd(
            "eval",
            str(tiny_llama),
            "--baseline",
            str(tiny_llama),
            "--tasks",
            "hamlet_next_line",
            "--limit",
            "4",
            "--max-drop",
            "0.5",
            "--no-cache",
        ),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "fatal" not in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_batch_refuses_an_out_that_holds_its_inputs(tmp_path: Path, tiny_llama: Path) -> None:
    """An earlier batch's OUT, replaced by --overwrite, must not hold the jobs file or a model."""
    out = tmp_path / "runs"
    (out / ".batch").mkdir(parents=True)
    model = out / "my-model"
    shutil.copytree(tiny_llama, model)
    jobs = out / "jobs.yaml"
    jobs.write_text(f"models: [{model}]\nrecipes:\n  - {{name: w8, stages: [{{quantize: {{scheme: w8a16}}}}]}}\n")  # fmt: skip
    line = refused(["batch", str(jobs), "--out", str(out), "--overwrite"], [out])
    assert f"would contain the jobs file {jobs}" in line
    jobs.rename(tmp_path / "jobs.yaml")
    line = refused(["batch", str(tmp_path / "jobs.yaml"), "--out", str(out), "--overwrite"], [out])
    assert f"would contain the model {model}" in line
