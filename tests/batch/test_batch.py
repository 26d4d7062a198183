"""`llmq batch` on this machine: expansion and keys, admission, failures that do not stop the
batch, resume, the summary, and one-line refusals of bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmq.batch.local import _admissible
from llmq.batch.run import plan_batch, run_batch
from llmq.batch.summary import SCHEMA, exit_code
from llmq.cli.main import app
from tests.batch.conftest import RECIPES, output_bytes, write_jobs
from tests.conftest import assert_bad_input

runner = CliRunner()
CLI = [sys.executable, "-m", "llmq.cli.main"]
GONE_WITHIN_S = 10  # a killed driver's workers (and their forkserver) are gone by then


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> dict[int, str]:
    """Every process below `root`, by pid, with its start time (pids can be reused)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        fields = _stat(pid)
        if fields is not None:
            found[pid] = fields[19]  # starttime
            todo.extend(children.get(pid, []))
    return found


def _alive(pid: int, started: str) -> bool:
    """The same process (same start time) still running (a zombie has ended)."""
    fields = _stat(pid)
    return fields is not None and fields[19] == started and fields[0] not in "ZX"


def test_expansion_only_and_keys(tmp_path, batch_models) -> None:
    only = "only: {tiny-b: [w8a16]}\n"
    plan = plan_batch(write_jobs(tmp_path, batch_models, extra=only), tmp_path / "out")
    assert [item.spec.id for item in plan.jobs] == [
        "tiny-a/w8a16", "tiny-a/w4a16-gptq", "tiny-b/w8a16",
    ]  # fmt: skip
    assert all(item.action == "run" for item in plan.jobs)
    keys = {item.spec.id: item.spec.key for item in plan.jobs}
    assert len(set(keys.values())) == 3  # model and recipe both enter the key
    # the same jobs again: the same keys; one recipe changed: only its jobs' keys change
    again = plan_batch(write_jobs(tmp_path, batch_models, extra=only), tmp_path / "out")
    assert {i.spec.id: i.spec.key for i in again.jobs} == keys
    changed = RECIPES.replace("scheme: w8a16, num_samples: 4", "scheme: w8a16, num_samples: 5")
    moved = plan_batch(write_jobs(tmp_path, batch_models, changed, only), tmp_path / "out")
    differ = {i.spec.id for i in moved.jobs if i.spec.key != keys[i.spec.id]}
    assert differ == {"tiny-a/w8a16", "tiny-b/w8a16"}
    # both models share one tokenizer: their calibration windows are computed once
    assert len(plan.windows) == 1


@pytest.mark.parametrize(
    ("jobs", "fragment"),
    [
        ("models: [nope]\nrecipes: [{name: a, stages: [{quantize: {scheme: w8a16}}]}]\n",
         "jobs.yaml:1: models[0]: model 'nope': no such folder"),
        ("models: [smollm2-135m]\nrecipes:\n  - {name: a, stages: [{quantize: {scheme: w9}}]}\n",
         "jobs.yaml:3: stages[0].quantize: unknown scheme 'w9'"),
        ("models: [smollm2-135m]\nrecipes: [missing.yaml]\n", "recipe file 'missing.yaml' not found"),
        ("models: [smollm2-135m]\nrecipes: [{name: a, stages: [{quantize: {scheme: fp8}}]}]\nonly: {x: [a]}\n",
         "'x' is not one of `models`"),
        ("models: [smollm2-135m]\nrecipe: []\n", "a mapping with `models` and `recipes`"),
    ],
)  # fmt: skip
def test_bad_jobs_files_are_refused_in_one_line(tmp_path, jobs: str, fragment: str) -> None:
    (tmp_path / "jobs.yaml").write_text(jobs)
    result = runner.invoke(
        app, ["batch", str(tmp_path / "jobs.yaml"), "--out", str(tmp_path / "o")]
    )
    assert_bad_input(result, fragment)
    assert not (tmp_path / "o").exists()


def test_a_jobs_file_that_is_not_utf8_is_refused_in_one_line(tmp_path, batch_models) -> None:
    """Non-UTF-8 bytes in the jobs file, or in a recipe file it names: one `error:` line naming
    the file and line, exit 2, no traceback, the files left as they were, nothing written."""
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(b"# caf\xe9\nstages: [{quantize: {scheme: w8a16}}]\n")
    cases = {  # the file, its bytes, where the error must point
        tmp_path / "jobs.yaml": (b"models: [x]\n# r\xe9sum\xe9\nrecipes: [a.yaml]\n", "jobs.yaml:2:"),
        tmp_path / "jobs2.yaml": (f"models: [{batch_models}/tiny-a]\nrecipes: [latin1.yaml]\n".encode(), "latin1.yaml:1:"),
    }  # fmt: skip
    for path, (data, where) in cases.items():
        path.write_bytes(data)
        result = runner.invoke(app, ["batch", str(path), "--out", str(tmp_path / "o")])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output and "UnicodeDecodeError" not in result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and where in errors[0] and "UTF-8" in errors[0], result.output
        assert path.read_bytes() == data
    assert recipe.read_bytes() == b"# caf\xe9\nstages: [{quantize: {scheme: w8a16}}]\n"
    assert not (tmp_path / "o").exists()


def test_a_read_only_out_prints_only_its_error(read_only_folder, tmp_path, batch_models) -> None:
    """No jobs table, no live table: the error and its hint."""
    jobs = str(write_jobs(tmp_path, batch_models))
    for extra in ([], ["--dry-run"], ["--json"]):
        result = runner.invoke(app, ["batch", jobs, "--out", str(read_only_folder / "out"), *extra])  # fmt: skip
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert lines[0].startswith("error:") and lines[1:] and all(line.startswith("  hint:") for line in lines[1:]), result.output  # fmt: skip
        assert "Read-only file system" in lines[0] or "Permission denied" in lines[0]
    assert list(read_only_folder.iterdir()) == []


def test_exit_code_of_a_batch_stopped_by_a_signal() -> None:
    """128 + the signal's number, whatever the jobs' statuses (as a shell reports it)."""
    jobs = [{"id": "a/b", "status": "interrupted"}, {"id": "a/c", "status": "passed"}]
    assert exit_code(jobs, signal.SIGINT) == 130 and exit_code(jobs, signal.SIGTERM) == 143
    assert exit_code(jobs) == 2


def test_bad_options_are_refused(tmp_path, batch_models) -> None:
    jobs = str(write_jobs(tmp_path, batch_models))
    assert_bad_input(runner.invoke(app, ["batch", jobs, "--out", str(tmp_path / "o"), "--jobs", "0"]), "--jobs 0")  # fmt: skip
    assert_bad_input(runner.invoke(app, ["batch", jobs, "--out", str(tmp_path / "o"), "--max-memory", "lots"]), "--max-memory 'lots'")  # fmt: skip
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.txt").write_text("keep me")
    assert_bad_input(runner.invoke(app, ["batch", jobs, "--out", str(tmp_path / "mine")]), "not an `llmq batch` output")  # fmt: skip
    assert (tmp_path / "mine" / "thesis.txt").read_text() == "keep me"


def test_admission_keeps_running_jobs_within_max_memory(tmp_path, batch_models) -> None:
    plan = plan_batch(write_jobs(tmp_path, batch_models), tmp_path / "out", parallel=4)
    peak = plan.jobs[0].peak_bytes
    plan.max_memory = int(2.5 * peak)  # room for two of these jobs at once, not three
    pending = list(plan.jobs)
    first = _admissible(pending, {}, plan)
    assert len(first) == 2  # four slots, memory for two
    running = {item.spec.id: (None, item, 0.0) for item in first}
    assert _admissible(pending[2:], running, plan) == []  # the third waits
    running.pop(first[0].spec.id)
    assert len(_admissible(pending[2:], running, plan)) == 1  # one finished: one more starts


@pytest.mark.process
def test_a_job_that_cannot_fit_is_refused_and_the_rest_run(tmp_path, batch_models) -> None:
    """A failing job (an eval against a baseline that is not there) and a refused one (a
    distillation needing more memory than allowed) are recorded; the others finish; exit 2."""
    recipes = RECIPES + (
        "  - {name: broken, stages: [{quantize: {scheme: w8a16, num_samples: 4, seq_len: 64}},"
        " {eval: {baseline: /nonexistent/model, max_windows: 1, seq_len: 64}}]}\n"
        "  - {name: big, stages: [{distill: {teacher: source, max_steps: 1}}]}\n"
    )
    jobs = write_jobs(tmp_path, batch_models, recipes, "only: {tiny-b: [w8a16]}\n")
    plan = plan_batch(jobs, tmp_path / "out")
    limit = max(item.peak_bytes for item in plan.jobs if not item.spec.id.endswith("/big"))
    result = runner.invoke(
        app, ["batch", str(jobs), "--out", str(tmp_path / "out"), "--jobs", "2",
              "--max-memory", str(limit)],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    status = {job["id"]: job["status"] for job in summary["jobs"]}
    assert status == {"tiny-a/w8a16": "passed", "tiny-a/w4a16-gptq": "passed",
                      "tiny-a/broken": "failed", "tiny-a/big": "refused",
                      "tiny-b/w8a16": "passed"}  # fmt: skip
    jobs_by_id = {job["id"]: job for job in summary["jobs"]}
    broken = jobs_by_id["tiny-a/broken"]
    assert "/nonexistent/model" in broken["error"] and "Traceback" in Path(broken["log"]).read_text()  # fmt: skip
    assert "more than --max-memory" in jobs_by_id["tiny-a/big"]["error"]
    assert not (tmp_path / "out" / "tiny-a" / "big").exists()  # refused before any work


@pytest.mark.process
def test_summary_schema_and_resume(tmp_path, batch_models) -> None:
    jobs = write_jobs(tmp_path, batch_models)
    out = tmp_path / "out"
    first = run_batch(jobs, out, parallel=2)
    data = json.loads((out / "summary.json").read_text())
    assert data == first.summary and data["schema"] == SCHEMA and first.exit_code == 0
    assert [job["id"] for job in data["jobs"]] == sorted(job["id"] for job in data["jobs"])
    for job in data["jobs"]:
        assert job["status"] == "passed" and job["seconds"] > 0 and job["peak_rss_bytes"] > 2**20
        assert job["output_bytes"] > 0 and Path(job["out"], "1-quantize", "config.json").is_file()
        assert job["shared_windows_reads"] == 1  # the windows the batch computed, not its own
    assert data["calibration_windows_computed"] == 1
    assert (out / "summary.md").read_text().count("| passed |") == 4
    before = output_bytes(out)
    # resume: every job finished with the same key -> skipped, nothing rewritten
    again = run_batch(jobs, out, resume=True)
    assert {job["status"] for job in again.summary["jobs"]} == {"skipped"}
    assert again.summary["calibration_windows_computed"] == 0
    # a changed recipe re-runs exactly its jobs
    changed = RECIPES.replace("scheme: w8a16, num_samples: 4", "scheme: w8a16, num_samples: 5")
    third = run_batch(write_jobs(tmp_path, batch_models, changed), out, resume=True)
    status = {job["id"]: job["status"] for job in third.summary["jobs"]}
    assert status == {"tiny-a/w8a16": "passed", "tiny-b/w8a16": "passed",
                      "tiny-a/w4a16-gptq": "skipped", "tiny-b/w4a16-gptq": "skipped"}  # fmt: skip
    after = output_bytes(out)
    assert {k for k in before if before[k] != after[k]} <= {k for k in before if "w8a16" in k}


@pytest.mark.slow  # three batches of four jobs: about two minutes on two cores
@pytest.mark.process
def test_sigkill_half_way_then_resume_gives_the_same_outputs(tmp_path, batch_models) -> None:
    """The driver is killed (SIGKILL) after its first job finished: its workers die with it,
    --resume skips the finished job and the outputs equal an uninterrupted batch's, byte for
    byte."""
    jobs = write_jobs(tmp_path, batch_models)
    reference = tmp_path / "reference"
    run_batch(jobs, reference)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "llmq.cli.main", "batch", str(jobs), "--out", str(out), "--json"]  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / ".batch" / "jobs"
    deadline = time.monotonic() + 120
    while not list(results.glob("*.result.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    below = _descendants(driver.pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    finished = {p.name for p in results.glob("*.result.json")}
    assert 1 <= len(finished) < 4
    _wait_gone(below)  # the workers die with the driver (no orphan keeps writing)
    resumed = run_batch(jobs, out, resume=True)
    status = [job["status"] for job in resumed.summary["jobs"]]
    assert status.count("skipped") == len(finished) and resumed.exit_code == 0
    assert output_bytes(out) == output_bytes(reference)


def _wait_gone(processes: dict[int, str]) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while any(_alive(pid, t) for pid, t in processes.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid, t in processes.items() if _alive(pid, t)]
    assert not left, f"still running {GONE_WITHIN_S} s after the driver was killed: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.process
def test_killed_driver_leaves_no_worker_and_one_resume_finishes(tmp_path, batch_models) -> None:
    """kill -9 of the driver while its two workers run: every process it started (workers,
    forkserver) is gone within seconds, so nothing holds a job's lock; one --resume then
    finishes both jobs (exit 0) and its summary says so."""
    jobs = tmp_path / "jobs.yaml"
    recipes = RECIPES.replace("w4a16-gptq", "w4a16").replace(", method: gptq", "")  # quicker
    jobs.write_text(f"models: [{batch_models}/tiny-a]\nrecipes:\n{recipes}")
    out = tmp_path / "out"
    command = [*CLI, "batch", str(jobs), "--out", str(out), "--jobs", "2", "--json"]
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / ".batch" / "jobs"
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while not workers and time.monotonic() < deadline and driver.poll() is None:
        workers = {s["pid"] for s in map(_json_or_none, state.glob("*.status.json")) if s and "pid" in s}  # fmt: skip
        time.sleep(0.05)
    below = _descendants(driver.pid)
    assert workers and workers <= set(below), (workers, below)  # a worker runs, below the driver
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    finished = {p.name.split("--")[1].removesuffix(".result.json") for p in state.glob("*.result.json")}  # fmt: skip
    assert len(finished) < 2
    _wait_gone(below)
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(resumed.stdout) == summary and summary["exit_code"] == 0
    status = {job["id"]: (job["status"], job.get("previous_status")) for job in summary["jobs"]}
    assert status == {
        f"tiny-a/{name}": ("skipped", "passed") if name in finished else ("passed", None)
        for name in ("w8a16", "w4a16")
    }
    assert (out / "summary.md").read_text().count("| passed |") == 2 - len(finished)
    for job in summary["jobs"]:
        assert Path(job["out"], "1-quantize", "config.json").is_file()
        assert "another llmq run" not in Path(job["log"]).read_text()


def _json_or_none(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.process
def test_sigint_stops_cleanly(tmp_path, batch_models) -> None:
    jobs = write_jobs(tmp_path, batch_models)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "llmq.cli.main", "batch", str(jobs), "--out", str(out), "--json"]  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status = out / ".batch" / "jobs"
    deadline = time.monotonic() + 120
    while not list(status.glob("*.status.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    driver.send_signal(signal.SIGINT)
    stdout, _ = driver.communicate(timeout=120)
    assert driver.returncode == 130  # as a shell reports a command Ctrl-C stopped
    summary = json.loads(stdout)
    assert summary["stopped_by"] == "SIGINT" and summary["exit_code"] == 130
    assert json.loads((out / "summary.json").read_text()) == summary
    states = {job["status"] for job in summary["jobs"]}
    assert states <= {"passed", "interrupted", "not_started"} and "not_started" in states
    resumed = run_batch(jobs, out, resume=True)
    assert resumed.exit_code == 0
    assert os.path.isfile(out / "summary.md")


def test_dry_run_shows_the_plan_and_writes_nothing(tmp_path, batch_models) -> None:
    jobs = write_jobs(tmp_path, batch_models)
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(tmp_path / "o"), "--dry-run", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    assert [job["id"] for job in planned] == [
        "tiny-a/w8a16", "tiny-a/w4a16-gptq", "tiny-b/w8a16", "tiny-b/w4a16-gptq",
    ]  # fmt: skip
    assert all(job["action"] == "run" and job["estimated_peak_bytes"] > 2**30 for job in planned)
    assert not (tmp_path / "o").exists()
    # --overwrite with --dry-run: the earlier batch's output is still there afterwards
    earlier = tmp_path / "earlier"
    (earlier / ".batch").mkdir(parents=True)
    (earlier / "summary.md").write_text("kept")
    again = runner.invoke(app, ["batch", str(jobs), "--out", str(earlier), "--dry-run", "--overwrite"])  # fmt: skip
    assert again.exit_code == 0, again.output
    assert (earlier / "summary.md").read_text() == "kept"
