"""`llmq batch --ray`: the same jobs as Ray tasks on one local Ray instance (started once for
the test run): outputs identical to the local run, a raising job reported while the others
finish, a killed worker retried, an output path a worker cannot write refused up front."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from typer.testing import CliRunner

from llmq.batch.ray_runner import check_ready
from llmq.batch.run import plan_batch, run_batch
from llmq.cli.main import app
from llmq.errors import InputError
from tests.batch.conftest import RECIPES, output_bytes, write_jobs
from tests.conftest import assert_bad_input

ray = pytest.importorskip("ray")
runner = CliRunner()

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20,
             log_to_driver=False)  # fmt: skip
    yield
    ray.shutdown()


def test_ray_outputs_equal_the_local_run(tmp_path, batch_models, ray_local) -> None:
    """With the same --jobs, so the same CPU threads per job (torch's float sums, and so GPTQ's
    rounding, depend on the thread count)."""
    jobs = write_jobs(tmp_path, batch_models)
    local = run_batch(jobs, tmp_path / "local")
    remote = run_batch(jobs, tmp_path / "ray", ray="local")
    assert remote.summary["runner"] == "ray local" and remote.exit_code == 0
    assert [j["status"] for j in remote.summary["jobs"]] == [j["status"] for j in local.summary["jobs"]]  # fmt: skip
    assert output_bytes(tmp_path / "ray") == output_bytes(tmp_path / "local")
    assert len(output_bytes(tmp_path / "ray")) == 4 * 3  # 4 jobs, 3 shards each


def test_a_raising_job_is_reported_and_the_others_finish(tmp_path, batch_models, ray_local):
    recipes = RECIPES + (
        "  - {name: broken, stages: [{quantize: {scheme: w8a16, num_samples: 4, seq_len: 64}},"
        " {eval: {baseline: /nonexistent/model, max_windows: 1, seq_len: 64}}]}\n"
    )
    result = run_batch(write_jobs(tmp_path, batch_models, recipes, "only: {tiny-b: [broken]}\n"),
                   tmp_path / "out", ray="local")  # fmt: skip
    status = {job["id"]: job["status"] for job in result.summary["jobs"]}
    assert status == {"tiny-a/w8a16": "passed", "tiny-a/w4a16-gptq": "passed",
                      "tiny-a/broken": "failed", "tiny-b/broken": "failed"}  # fmt: skip
    assert result.exit_code == 2  # an application error: recorded once, not retried
    log = (tmp_path / "out" / "logs" / "tiny-b--broken.log").read_text()
    assert log.count("== tiny-b/broken: 20") == 1


def test_a_worker_killed_mid_job_is_retried(tmp_path, batch_models, ray_local) -> None:
    jobs = write_jobs(tmp_path, batch_models, extra="only: {tiny-a: [w4a16-gptq], tiny-b: [w8a16]}\n")  # fmt: skip
    out = tmp_path / "out"
    status_file = out / ".batch" / "jobs" / "tiny-a--w4a16-gptq.status.json"
    killed: list[int] = []

    def kill_once() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                state = json.loads(status_file.read_text())
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            os.kill(state["pid"], signal.SIGKILL)
            killed.append(state["pid"])
            return

    killer = threading.Thread(target=kill_once)
    killer.start()
    result = run_batch(jobs, out, ray="local")
    killer.join()
    assert killed, "the job never reported a status"
    assert {job["status"] for job in result.summary["jobs"]} == {"passed"}
    log = (out / "logs" / "tiny-a--w4a16-gptq.log").read_text()
    assert log.count("== tiny-a/w4a16-gptq: 20") == 2  # started twice: killed, then retried


def test_an_output_path_a_worker_cannot_write_is_refused(tmp_path, batch_models, ray_local):
    """The driver refuses an OUT it cannot write itself when planning; one that it can write
    but a worker cannot (storage not mounted on that node) is refused by a probe task."""
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "a-file" / "out"
    jobs = write_jobs(tmp_path, batch_models)
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(out), "--ray", "local"])
    assert_bad_input(result, "Not a directory")
    plan = plan_batch(jobs, tmp_path / "out")
    plan.out = out  # as a worker that does not mount OUT's storage sees it
    with pytest.raises(InputError, match="a Ray worker cannot write there"):
        check_ready(plan, "local")


def test_gpus_per_job_needs_ray_and_gpus_the_cluster_has(tmp_path, batch_models, ray_local):
    jobs, out = str(write_jobs(tmp_path, batch_models)), str(tmp_path / "o")
    result = runner.invoke(app, ["batch", jobs, "--out", out, "--gpus-per-job", "1"])
    assert_bad_input(result, "reserves GPUs for Ray tasks")
    result = runner.invoke(app, ["batch", jobs, "--out", out, "--ray", "local", "--gpus-per-job", "1"])  # fmt: skip
    assert_bad_input(result, "more than the Ray cluster's 0 GPUs")
