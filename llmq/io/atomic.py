"""Outputs appear complete or not at all, written by one run at a time, or fail in one line.

Every output llmq writes (a checkpoint folder, a statistics file, a report) goes through here:

- `claim_output`: one writer per output. An OS-level lock (`flock`) on `.NAME.llmq-lock` next to
  the output, held from before the first check until after the output is published, so two runs
  on one OUT never share a staging folder. The kernel releases it when the holder dies, so a
  killed run never leaves a stale lock. The lock file sits beside the output, not inside the
  staging folder, because the staging folder is renamed into place while the lock is held.
- `refuse_inputs`: an output that is, holds or lies inside one of the run's inputs is refused
  before anything is written (`claim_output` checks it first), so no input is ever written into
  or, with `overwrite=True`, deleted.
- `partial_file` / `publish`: write under a temporary name, rename when complete. Nothing the user
  gave us is overwritten without `overwrite=True`; even then only a folder llmq wrote (or an empty
  one) is replaced, and only after the new one is in place.
- `llmq.io.space.check_free_space`: refuse before any work when the output cannot fit.
- `output_error`: an `OSError` (no space, read-only, no permission, a parent that cannot be
  created, a name too long) becomes one `OutputError` line naming the path and what to try.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.errors import InputError, OutputError

if TYPE_CHECKING:
    from llmq.io.record import OutputRecord

LOCK_SUFFIX = ".llmq-lock"
PARTIAL_SUFFIX = ".partial"
_PARTIAL_NAME = re.compile(r"\..+\.\d+-[0-9a-f]+" + re.escape(PARTIAL_SUFFIX))  # partial_file's
_HOLDER_READ_TRIES = 20  # a new holder writes its details right after locking: wait up to 0.2 s


def staging_path(out: Path) -> Path:
    """The partial output of a run into `out`; kept after an interruption for --resume."""
    return out.parent / f".{out.name}.llmq-partial"


def lock_path(out: Path) -> Path:
    """The lock file that makes one run at a time the writer of `out`."""
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


@dataclass(frozen=True, slots=True)
class LockHolder:
    """Who holds an output's lock, as it wrote itself into the lock file."""

    pid: int
    host: str
    started: str  # UTC, ISO 8601

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"


InputPaths = Iterable[tuple[str, "str | Path | None"]]  # (what it is, path): ("model", ckpt.path)


def refuse_inputs(out: Path, inputs: InputPaths) -> None:
    """Refuse, with one InputError line, an output that is one of the run's inputs, holds one
    (writing it, or replacing it with --overwrite, would delete it) or lies inside one (writing
    it would change it). Paths are compared resolved, so symbolic links and `..` cannot hide an
    input. Touches nothing on disk."""
    target = Path(out).resolve()
    for role, given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if target == source:
            relation = "is"
        elif target in source.parents:
            relation = "would contain"
        elif source in target.parents:
            relation = "would be inside"
        else:
            continue
        raise InputError(
            f"{out}: the output {relation} the {role} {given}",
            hint="choose an output outside every input: llmq never writes into or deletes its inputs",
        )


@contextmanager
def claim_output(
    out: Path, *, inputs: InputPaths, kept: Callable[[], str | None] | None = None
) -> Iterator[None]:
    """Hold the one-writer lock of `out` for the block, or raise InputError at once naming the
    run that holds it. First refuses an output over one of `inputs` (`refuse_inputs`), before
    anything is created. Creates `out`'s parent folders. An OSError in the block (or while
    claiming) becomes one OutputError line; `kept` then says what of the partial output survived
    (see `output_error`)."""
    out = Path(out)
    refuse_inputs(out, inputs)
    path = lock_path(out)
    try:
        _make_parent(out)
        fd = _acquire(path, out)
    except OSError as exc:
        if exc.filename == str(path):  # name what the user gave, not our lock file
            exc = OSError(exc.errno, exc.strerror, str(out))
        raise output_error(exc, out) from None
    try:
        yield
    except OSError as exc:
        raise output_error(exc, out, kept=kept) from None
    finally:
        # Unlink while still holding the lock: a run that opened the old file sees, once it gets
        # the lock, that the name no longer leads to its file and tries again (`_acquire`).
        with suppress(OSError):  # a leftover lock file is harmless: the lock lives in the kernel
            path.unlink(missing_ok=True)
        os.close(fd)


@contextmanager
def claim_outputs(paths: list[Path], *, inputs: InputPaths) -> Iterator[None]:
    """`claim_output` for each of several outputs of one run (a report in several formats)."""
    inputs = list(inputs)
    with ExitStack() as stack:
        for path in paths:
            stack.enter_context(claim_output(path, inputs=inputs))
        yield


def _make_parent(out: Path) -> None:
    """Create OUT's parent folders; a file in the parent's place is ENOTDIR, as it is for any
    file further up the path (mkdir would say "File exists")."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(
            errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out.parent)
        ) from None


def _acquire(path: Path, out: Path) -> int:
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise InputError(
                f"{out}: another llmq run is writing it "
                f"({holder.describe() if holder else 'its details are not readable'})",
                hint="wait for that run to finish, or stop it: a stopped run frees it at once",
            ) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # the previous holder removed the file after we opened it: take the new one
    holder = LockHolder(
        os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    )
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(holder)).encode(), 0)
    except OSError:
        os.close(fd)
        raise
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> LockHolder | None:
    for _ in range(_HOLDER_READ_TRIES):
        try:
            return LockHolder(**json.loads(os.pread(fd, 4096, 0)))
        except (ValueError, TypeError):
            time.sleep(0.01)
    return None


def check_output_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse an existing output without overwrite, and with it a folder llmq did not write
    (`is_llmq_output`) unless it is empty: --overwrite never deletes another tool's output or a
    user's files. Inputs are refused earlier, by `claim_output`."""
    if out.parent.exists() and not out.parent.is_dir():
        raise InputError(f"{out.parent}: not a folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    if not overwrite:
        raise InputError(f"{out}: already exists", hint="choose another --out or pass --overwrite")
    if any(out.iterdir()) and not is_llmq_output(out):
        raise InputError(
            f"{out}: not written by llmq (no llmq.json or llmq-run.json), so --overwrite "
            "will not replace it",
            hint="choose another --out, or empty or remove that folder yourself",
        )


def check_output_file(
    path: Path, *, overwrite: bool, ours: Callable[[Path], bool], kind: str
) -> None:
    """Refuse an existing file without `overwrite`, and even with it any file that `ours` does
    not recognise as one llmq wrote (`kind` names what that is): --overwrite never replaces a
    user's file."""
    if not path.exists():
        return
    if path.is_dir():
        raise InputError(f"{path}: a folder", hint=f"name a file for the {kind}")
    if not overwrite:
        raise InputError(f"{path}: already exists", hint="choose another path or pass --overwrite")
    if not ours(path):
        raise InputError(
            f"{path}: not {kind} llmq wrote, so --overwrite will not replace it",
            hint="choose another path, or remove that file yourself",
        )


def is_llmq_output(folder: Path) -> bool:
    """Whether llmq wrote `folder`: a checkpoint whose llmq.json names the llmq version that
    wrote it, or an `llmq run` output with its llmq-run.json."""
    from llmq.io.checkpoint import RUN_RECORD_FILE
    from llmq.io.record import OutputRecord

    return OutputRecord.read(folder).written_by_llmq or (folder / RUN_RECORD_FILE).is_file()


def remove_partial_leftovers(folder: Path) -> None:
    """Remove the partial files (`partial_file`'s names) a process killed while writing left in
    `folder`: never published, so nothing anyone relies on."""
    if folder.is_dir():
        for leftover in folder.iterdir():
            if _PARTIAL_NAME.fullmatch(leftover.name) and leftover.is_file():
                leftover.unlink(missing_ok=True)


def publish(staging: Path, out: Path) -> None:
    """Move a complete staging folder to `out`; an existing `out` is replaced only afterwards.
    Leftover partial files of an interrupted earlier run are removed first."""
    remove_partial_leftovers(staging)
    old = out.parent / f".{out.name}.llmq-old"
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def partial_file(path: Path) -> Iterator[Path]:
    """A temporary name next to `path` to write into; renamed to `path` when the block
    succeeds, removed when it fails. Each call gets its own name, so concurrent writers of one
    cache file never write into each other's partial file (the last rename wins, whole)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
    try:
        yield partial
        partial.replace(path)
    except OSError as exc:
        if exc.filename != str(partial):
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from None  # the name the user knows
    finally:
        partial.unlink(missing_ok=True)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temporary file, fsync, rename)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write text atomically (temporary file, fsync, rename)."""
    with partial_file(path) as partial, partial.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_safetensors(
    path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """safetensors.save_file, atomically. Its I/O failures are raised as OSError with their
    errno (safetensors reports them as SafetensorError text)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with partial_file(path) as partial:
        try:
            save_file(
                {k: v.contiguous() for k, v in tensors.items()}, str(partial), metadata=metadata
            )
        except SafetensorError as exc:
            raise _as_os_error(exc, partial) from None
        os.chmod(partial, file_mode())  # safetensors creates its files 0600


def file_mode() -> int:
    """The mode a new file gets from open(): 0666 less the process's umask. Linux shows the
    umask in /proc; elsewhere it can only be read by setting it, briefly."""
    try:
        status = Path("/proc/self/status").read_text()
        umask = int(next(line for line in status.splitlines() if line.startswith("Umask:")).split()[1], 8)  # fmt: skip
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def _as_os_error(exc: Exception, path: Path) -> Exception:
    """SafetensorError("... I/O error: No space left on device (os error 28)") -> OSError(28)."""
    text = str(exc)
    marker = "(os error "
    if marker not in text:
        return exc
    code = int(text.rsplit(marker, 1)[1].split(")", 1)[0])
    return OSError(code, os.strerror(code), str(path))


# What to try, per errno, when writing an output failed.
_IO_HINTS: dict[int, str] = {
    errno.ENOSPC: "free some space on that file system (or choose another output location)",
    errno.EDQUOT: "your disk quota is used up: free some space (or choose another output location)",
    errno.EROFS: "the file system is read-only: choose another output location",
    errno.EACCES: "you may not write there: choose a folder you can write, or fix its permissions",
    errno.EPERM: "you may not write there: choose a folder you can write, or fix its permissions",
    errno.ENOENT: "a folder on the way does not exist and cannot be created: check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.ENAMETOOLONG: "the path or a name in it is too long: choose a shorter path",
    errno.EXDEV: "the staging folder is on another file system than the output, so the final "
    "rename would not be atomic: choose an output that is not a mount point",
    errno.EBUSY: "another program holds that path (a mount point, an open file): choose another",
    errno.EIO: "the device reported an I/O error: check the disk",
}


def output_error(
    exc: OSError, path: Path | None = None, *, kept: Callable[[], str | None] | None = None
) -> OutputError:
    """One line for a failed write: the path that failed (the error's own, else `path`), why,
    and what to try. `kept` is called to say what of the partial output survived (for example
    a --resume hint), if anything."""
    where = exc.filename or path
    reason = exc.strerror or str(exc)
    message = f"{where}: {reason}" if where else reason
    hints = [_IO_HINTS.get(exc.errno or -1), kept() if kept else None]
    return OutputError(message, hint="; ".join(h for h in hints if h) or None)


def write_record(folder: Path, record: OutputRecord) -> None:
    """Write `record` as the llmq.json of the checkpoint being written at `folder`."""
    from llmq.io.record import RECORD_FILE

    write_json(folder / RECORD_FILE, record.to_dict())


def add_to_record(folder: Path, **sections: dict[str, Any]) -> None:
    """Add sections to the record of the checkpoint written at `folder` (a distillation's
    summary to the quantized export it made)."""
    from llmq.io.record import OutputRecord

    record = OutputRecord.read(folder, strict=True)
    for name, section in sections.items():
        setattr(record, name, section)
    write_record(folder, record)
