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

from llmq.api.batch import batch, plan_batch
from llmq.batch.local import _admissible
from llmq.batch.summary import SCHEMA
from llmq.cli.main import app
from tests.batch.conftest import RECIPES, output_bytes, write_jobs
from tests.conftest import assert_bad_input

runner = CliRunner()


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


def test_summary_schema_and_resume(tmp_path, batch_models) -> None:
    jobs = write_jobs(tmp_path, batch_models)
    out = tmp_path / "out"
    first = batch(jobs, out, parallel=2)
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
    again = batch(jobs, out, resume=True)
    assert {job["status"] for job in again.summary["jobs"]} == {"skipped"}
    assert again.summary["calibration_windows_computed"] == 0
    # a changed recipe re-runs exactly its jobs
    changed = RECIPES.replace("scheme: w8a16, num_samples: 4", "scheme: w8a16, num_samples: 5")
    third = batch(write_jobs(tmp_path, batch_models, changed), out, resume=True)
    status = {job["id"]: job["status"] for job in third.summary["jobs"]}
    assert status == {"tiny-a/w8a16": "passed", "tiny-b/w8a16": "passed",
                      "tiny-a/w4a16-gptq": "skipped", "tiny-b/w4a16-gptq": "skipped"}  # fmt: skip
    after = output_bytes(out)
    assert {k for k in before if before[k] != after[k]} <= {k for k in before if "w8a16" in k}


def test_sigkill_half_way_then_resume_gives_the_same_outputs(tmp_path, batch_models) -> None:
    """The driver is killed (SIGKILL) after its first job finished: its workers die with it,
    --resume skips the finished job and the outputs equal an uninterrupted batch's, byte for
    byte."""
    jobs = write_jobs(tmp_path, batch_models)
    reference = tmp_path / "reference"
    batch(jobs, reference)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "llmq.cli.main", "batch", str(jobs), "--out", str(out), "--json"]  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / ".batch" / "jobs"
    deadline = time.monotonic() + 120
    while not list(results.glob("*.result.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    finished = {p.name for p in results.glob("*.result.json")}
    assert 1 <= len(finished) < 4
    time.sleep(1)  # the workers die with the driver (no orphan keeps writing)
    resumed = batch(jobs, out, resume=True)
    status = [job["status"] for job in resumed.summary["jobs"]]
    assert status.count("skipped") == len(finished) and resumed.exit_code == 0
    assert output_bytes(out) == output_bytes(reference)


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
    assert driver.returncode == 2
    summary = json.loads(stdout)
    states = {job["status"] for job in summary["jobs"]}
    assert states <= {"passed", "interrupted", "not_started"} and "not_started" in states
    resumed = batch(jobs, out, resume=True)
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
