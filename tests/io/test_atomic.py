"""Output safety primitives: the one-writer lock (real processes), partial files, the space
check and the one-line rendering of I/O failures."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from llmq.errors import InputError, OutputError
from llmq.io.atomic import (
    claim_output,
    lock_path,
    output_error,
    partial_file,
    publish,
    save_safetensors,
    write_json,
)
from llmq.io.space import check_free_space

HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from llmq.io.atomic import claim_output
    with claim_output(Path(sys.argv[1]), inputs=()):
        print("held", flush=True)
        time.sleep(60)
    """
)


def hold_lock(out: Path) -> subprocess.Popen[str]:
    """A real process that claims `out` and sleeps holding it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.process
def test_a_second_writer_is_refused_naming_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        with pytest.raises(InputError) as refused, claim_output(out, inputs=()):
            pytest.fail("claimed an output another process holds")
        assert f"pid {holder.pid} on {os.uname().nodename}, started 20" in refused.value.message
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.process
def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = hold_lock(out)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert lock_path(out).exists()  # SIGKILL ran no cleanup; the kernel dropped the lock
    with claim_output(out, inputs=()):
        (out.parent / "inside").write_text("claimed")
    assert not lock_path(out).exists()


def test_a_released_claim_removes_its_lock_file_and_can_be_claimed_again(tmp_path: Path) -> None:
    out = tmp_path / "new" / "out"
    for _ in range(2):
        with claim_output(out, inputs=()):
            assert lock_path(out).is_file()
        assert not lock_path(out).exists()


def test_os_errors_inside_a_claim_become_one_output_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with (
        pytest.raises(OutputError) as failed,
        claim_output(out, inputs=(), kept=lambda: "kept for --resume"),
    ):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "shard"))
    assert failed.value.message == f"{out / 'shard'}: No space left on device"
    assert failed.value.hint is not None and failed.value.hint.endswith("; kept for --resume")
    assert not lock_path(out).exists()


def test_an_uncreatable_parent_is_an_output_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OutputError, match="Not a directory") as failed, claim_output(blocker / "sub" / "out", inputs=()):  # fmt: skip
        pass
    assert "part of the path is a file" in str(failed.value.hint)


@pytest.mark.parametrize(
    ("code", "fragment"),
    [
        (errno.ENOSPC, "free some space"),
        (errno.EROFS, "read-only"),
        (errno.EACCES, "may not write"),
        (errno.ENAMETOOLONG, "too long"),
        (errno.EXDEV, "would not be atomic"),
    ],
)
def test_each_io_failure_says_what_to_try(code: int, fragment: str) -> None:
    error = output_error(OSError(code, os.strerror(code), "/x/out"))
    assert error.message == f"/x/out: {os.strerror(code)}" and error.exit_code == 2
    assert fragment in str(error.hint)


def test_partial_files_are_private_to_each_writer(tmp_path: Path) -> None:
    """Two writers of one cache entry never share a partial file; a failed write leaves none."""
    path = tmp_path / "entry.json"
    with partial_file(path) as first, partial_file(path) as second:
        assert first != second
        first.write_text("1")
        second.write_text("2")
    assert path.read_text() == "1"  # `first` was renamed last: the last rename wins, whole
    with pytest.raises(ValueError), partial_file(path) as partial:
        partial.write_text("half")
        raise ValueError("interrupted")
    assert path.read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["entry.json"]


def test_a_failed_write_names_the_file_not_its_partial(tmp_path: Path) -> None:
    missing = tmp_path / "gone" / "config.json"
    with pytest.raises(OSError) as failed:
        write_json(missing, {})
    assert failed.value.filename == str(missing)


def test_safetensors_io_errors_keep_their_errno(tmp_path: Path, monkeypatch) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")  # fmt: skip

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    path = tmp_path / "shard.safetensors"
    with pytest.raises(OSError) as failed:
        save_safetensors(path, {"w": torch.zeros(2)})
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []


def test_publish_drops_partial_files_a_killed_run_left(tmp_path: Path) -> None:
    staging, out = tmp_path / ".out.llmq-partial", tmp_path / "out"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    (staging / ".shard.safetensors.123-abcd.partial").write_bytes(b"half")
    publish(staging, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_space_check_refuses_what_cannot_fit(tmp_path: Path) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    check_free_space(tmp_path / "not" / "yet" / "made", free // 2)  # an ancestor answers
    with pytest.raises(OutputError, match=r"needs about .* free") as refused:
        check_free_space(tmp_path / "out", free * 2)
    assert "--no-space-check" in str(refused.value.hint)


@pytest.mark.process
def test_the_lock_waits_for_nobody(tmp_path: Path) -> None:
    """A refused claim answers at once, not after the holder finishes."""
    out = tmp_path / "out"
    holder = hold_lock(out)
    try:
        started = time.monotonic()
        with pytest.raises(InputError), claim_output(out, inputs=()):
            pass
        assert time.monotonic() - started < 5
    finally:
        holder.kill()
        holder.wait()
