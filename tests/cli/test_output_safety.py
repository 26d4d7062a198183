"""Every output llmq writes is safe: one writer per output (real processes), a full disk or a
read-only folder is one `error:` line with exit 2 and never a traceback, and a run stopped by a
full disk resumes once space is freed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from llmq.io.atomic import lock_path, staging_path
from tests.conftest import make_tiny
from tests.pipeline.test_quantize import checkpoint_bytes

runner = CliRunner()
SLOW_RUN = ["--scheme", "w4a16", "--num-samples", "16", "--seq-len", "256", "--resume-every", "0"]


def llmq_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmq.cli.main", *args]


def one_error_line(output: str) -> str:
    """The single `error:` line of a refused command, checked to come without a traceback."""
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Name, size and modification time of each entry (none for a folder not made yet)."""
    if not folder.is_dir():
        return {}
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def model8(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """Eight layers: a run lasts long enough to be caught holding its output."""
    return make_tiny(tmp_path_factory.mktemp("model8") / "model", default_model, layers=8)


def wait_for_lock(proc: subprocess.Popen[bytes], out: Path) -> None:
    """Until `proc` has written itself into OUT's lock file."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(lock_path(out).read_text())["pid"] == proc.pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    pytest.fail("the first run never held its output")


@pytest.mark.process
def test_a_second_run_on_one_out_exits_2_and_touches_nothing(tmp_path: Path, model8: Path) -> None:
    reference = tmp_path / "alone"
    llmq.quantize(model8, reference, scheme="w4a16", num_samples=16, seq_len=256)
    out = tmp_path / "out"
    first = subprocess.Popen(llmq_cmd("quantize", str(model8), "--out", str(out), *SLOW_RUN))
    try:
        wait_for_lock(first, out)
        os.kill(first.pid, signal.SIGSTOP)  # hold it there, whatever this machine's speed
        before = snapshot(tmp_path) | snapshot(staging_path(out))
        for extra in ([], ["--resume"], ["--overwrite"]):
            second = subprocess.run(
                llmq_cmd("quantize", str(model8), "--out", str(out), "--scheme", "w8a16", *extra),
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert second.returncode == 2, second.stderr
            line = one_error_line(second.stderr)
            assert f"another llmq run is writing it (pid {first.pid} on " in line
            assert snapshot(tmp_path) | snapshot(staging_path(out)) == before
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=300) == 0
    assert checkpoint_bytes(out) == checkpoint_bytes(reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "out"]  # no lock, no staging


@pytest.mark.process
def test_calibrate_and_scan_reports_have_one_writer(tmp_path: Path, tiny_llama: Path) -> None:
    from tests.io.test_atomic import hold_lock

    stats, report = tmp_path / "stats.safetensors", tmp_path / "scan.json"
    for out, command in (
        (stats, ["calibrate", str(tiny_llama), "--out", str(stats), "--num-samples", "2"]),
        (report, ["fallback-scan", str(tiny_llama), "--report", str(report)]),
    ):
        holder = hold_lock(out)
        try:
            result = runner.invoke(app, command)
        finally:
            holder.kill()
            holder.wait()
        assert result.exit_code == 2
        assert f"another llmq run is writing it (pid {holder.pid}" in one_error_line(result.output)
        assert not out.exists()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 64 MB (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.process
def test_a_full_disk_is_one_line_and_the_run_resumes(
    tmp_path: Path, tiny_llama: Path, small_fs: Path
) -> None:
    """ENOSPC on a real small file system: refused before any work by the space check; with
    --no-space-check, one line and exit 2 mid-run, the finished layers kept; after space is
    freed, --resume completes the checkpoint byte-identical to a run alone."""
    reference = tmp_path / "alone"
    llmq.quantize(tiny_llama, reference, scheme="w8a16", skip_layer_check=True, model_free=False)
    shards = sorted(reference.glob("model-*.safetensors"))
    # room for the embeddings' shard and the first layer's, not for the second layer's
    room = shards[0].stat().st_size + shards[1].stat().st_size + 64 * 1024
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (64 * 2**20 - room))
    out = small_fs / "out"
    cmd = llmq_cmd("quantize", str(tiny_llama), "--out", str(out), "--scheme", "w8a16", "--skip-layer-check", "--no-model-free")  # fmt: skip

    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "needs about" in one_error_line(refused.stderr)
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # nothing written

    full = subprocess.run([*cmd, "--no-space-check"], capture_output=True, text=True, timeout=120)
    assert full.returncode == 2
    assert "No space left on device" in one_error_line(full.stderr)
    assert "--resume" in full.stderr and not out.exists()
    assert (staging_path(out) / "llmq-state.json").is_file()

    filler.unlink()
    resumed = subprocess.run([*cmd, "--resume", "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed_layers"] >= 1
    assert checkpoint_bytes(out) == checkpoint_bytes(reference)


@pytest.mark.parametrize("path", ["model-free", "layer pipeline"])
def test_a_full_disk_without_a_resume_point_leaves_nothing(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """ENOSPC before the first resume point (simulated where no small file system can be
    mounted), in either writer (model-free's streamed shards, safetensors' save_file): one
    line, exit 2, and no staging folder left to clutter OUT's parent."""
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    from llmq.io.stream import StreamedSafetensors

    def full(*args: object, **kwargs: object) -> None:
        raise SafetensorError(f"I/O error: No space left on device (os error {errno.ENOSPC})")

    def full_stream(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if path == "model-free":
        monkeypatch.setattr(StreamedSafetensors, "_write", full_stream)
    else:
        monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "out"
    choice = "--model-free" if path == "model-free" else "--no-model-free"
    result = runner.invoke(app, ["quantize", str(tiny_llama), "--out", str(out), "--scheme", "w8a16", "--skip-layer-check", choice])  # fmt: skip
    assert result.exit_code == 2
    assert "No space left on device" in one_error_line(result.output)
    assert list(tmp_path.iterdir()) == []


def test_every_command_under_a_read_only_folder_fails_in_one_line(
    read_only_folder: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(tiny_llama)
    writers = {
        "quantize": ["quantize", model, "--out", str(read_only_folder / "q"), "--scheme", "w8a16"],
        "quantize, new parent": ["quantize", model, "--out", str(read_only_folder / "a" / "q")],
        "calibrate": ["calibrate", model, "--out", str(read_only_folder / "s.safetensors")],
        "scan --report": ["fallback-scan", model, "--report", str(read_only_folder / "r.json")],
        "scan --csv": ["fallback-scan", model, "--csv", str(read_only_folder / "r.csv")],
        "scan --markdown": ["fallback-scan", model, "--markdown", str(read_only_folder / "r.md")],
    }
    for name, command in writers.items():
        result = runner.invoke(app, command)
        assert result.exit_code == 2, (name, result.output)
        line = one_error_line(result.output)
        assert "Read-only file system" in line or "Permission denied" in line, (name, line)
    # Commands that write only to the cache still work, with a warning about the cache.
    monkeypatch.setenv("LLMQ_CACHE_DIR", str(read_only_folder / "cache"))
    for command in (
        ["eval", model, "--baseline", model, "--eval-windows", "1", "--seq-len", "64"],
        ["models"],
    ):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output and "error:" not in result.output
    assert list(read_only_folder.iterdir()) == []


def test_a_name_too_long_and_a_file_in_the_path_fail_in_one_line(
    tmp_path: Path, tiny_llama: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for out, reason in (
        (tmp_path / ("x" * 300), "File name too long"),
        (blocker / "out", "Not a directory"),
    ):
        result = runner.invoke(app, ["quantize", str(tiny_llama), "--out", str(out), "--scheme", "w8a16"])  # fmt: skip
        assert result.exit_code == 2
        assert reason in one_error_line(result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
