"""What there is to scan, from the safetensors headers alone: no tensor is read here.

Every float tensor of every readable .safetensors file under the scanned path becomes a `Job`;
integer, scalar and empty tensors are `Skipped` with the reason; files that cannot be read, and
shards that an index names but that are absent, go to `failed` (the rest is still scanned).
The --include / --exclude filters apply here, and a filter that leaves no tensor is an
InputError. `reading_order` is the order in which the report lists names.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from llmq.errors import InputError
from llmq.fallback.report import Skipped
from llmq.io.checkpoint import (
    INDEX_FILE,
    HeaderEntry,
    absent_shard,
    broken_link,
    read_config,
    read_index,
    read_safetensors_header,
)
from llmq.io.family import transposed_weights

_READABLE = {"BF16", "F16", "F32", "F8_E4M3", "F8_E5M2"}
_DIGITS = re.compile(r"([0-9]+)")


@dataclass(slots=True)
class Job:
    name: str
    file: Path
    relative: str  # the file's path under the scanned folder, as reported
    entry: HeaderEntry
    # stored [..., in, out] (GPT-OSS's fused experts): scanned transposed, so that rows are a
    # linear's output channels, as quantize groups them
    transposed: bool = False

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


@dataclass(slots=True)
class Inventory:
    jobs: list[Job] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # file -> one-line error


def safetensors_files(root: Path) -> list[Path]:
    """The .safetensors files under `root` (or `root` itself), InputError when there are none."""
    if not root.exists():
        raise InputError(f"{root}: no such file or folder")
    if root.is_file():
        if root.suffix != ".safetensors":
            raise InputError(f"{root}: not a .safetensors file")
        return [root]
    files = sorted(p for p in root.rglob("*.safetensors") if p.is_file() or broken_link(p))
    if not files:
        raise InputError(
            f"{root}: no .safetensors files in this folder or below",
            hint="fallback-scan reads safetensors checkpoints only",
        )
    return files


def take_inventory(
    root: Path, include: re.Pattern[str] | None, exclude: re.Pattern[str] | None
) -> Inventory:
    """Every tensor to scan, from the headers alone; unreadable files are recorded, not fatal."""
    inventory = Inventory()
    base = root if root.is_dir() else root.parent
    for index in sorted(base.rglob(INDEX_FILE)) if root.is_dir() else []:
        _check_index(index, base, inventory)
    names: list[str] = []  # every tensor of the readable files, to check the filters
    transposed = _TransposedWeights()
    for file in safetensors_files(root):
        try:
            header = read_safetensors_header(file)
        except InputError as exc:
            inventory.failed[_relative(file, base)] = exc.message.removeprefix(f"{file}: ")
            continue
        names.extend(header)
        for name, entry in header.items():
            if (include and not include.search(name)) or (exclude and exclude.search(name)):
                continue
            reason = _skip_reason(entry.dtype, entry.shape)
            relative = _relative(file, base)
            if reason:
                inventory.skipped.append(
                    Skipped(name, relative, entry.dtype, list(entry.shape), reason)
                )
            else:
                inventory.jobs.append(Job(name, file, relative, entry, transposed(file, name)))
    _check_filters_matched(names, inventory, include, exclude)
    inventory.jobs.sort(key=lambda job: -job.nbytes)  # largest first: workers finish together
    inventory.skipped.sort(key=lambda s: reading_order(s.file, s.name))
    return inventory


class _TransposedWeights:
    """Whether a file's tensor is stored transposed, by the config.json beside the file (read
    once per folder; none, or one llmq cannot read: nothing is)."""

    def __init__(self) -> None:
        self._patterns: dict[Path, re.Pattern[str] | None] = {}

    def __call__(self, file: Path, name: str) -> bool:
        folder = file.parent
        if folder not in self._patterns:
            try:
                self._patterns[folder] = transposed_weights(read_config(folder))
            except InputError:
                self._patterns[folder] = None
        pattern = self._patterns[folder]
        return pattern is not None and pattern.fullmatch(name) is not None


def _check_filters_matched(
    names: list[str],
    inventory: Inventory,
    include: re.Pattern[str] | None,
    exclude: re.Pattern[str] | None,
) -> None:
    """A filter that leaves no tensor is a mistake (a typo, a wrong naming scheme), not a clean
    scan: `--fail-on-flagged` would pass a CI gate that looked at nothing."""
    if not names or inventory.jobs or inventory.skipped:
        return
    given = [f"{option} {pattern.pattern!r}" for option, pattern in (("--include", include), ("--exclude", exclude)) if pattern]  # fmt: skip
    raise InputError(
        f"{' '.join(given)}: none of the {len(names)} tensors is left to scan",
        hint=f"patterns are regular expressions searched in names such as {min(names, key=reading_order)!r}",
    )


def _check_index(index: Path, base: Path, inventory: Inventory) -> None:
    try:
        shards = {str(shard) for shard in read_index(index).values()}
    except (InputError, OSError) as exc:
        inventory.failed[_relative(index, base)] = str(exc).removeprefix(f"{index}: ")
        return
    for path in sorted(index.parent / shard for shard in shards):
        if not path.is_file():
            inventory.failed[_relative(path, base)] = absent_shard(path)


def _relative(file: Path, base: Path) -> str:
    try:
        return str(file.relative_to(base))
    except ValueError:
        return str(file)


def _skip_reason(dtype: str, shape: tuple[int, ...]) -> str | None:
    if dtype not in _READABLE:
        if dtype.startswith(("I", "U", "BOOL")):
            return f"integer tensor ({dtype}): packed codes, indices or scales, not a float weight"
        return f"{dtype} is not scanned (bf16, fp16, fp32 and fp8 are)"
    if not shape or math.prod(shape) == 0:
        return "scalar or empty"
    return None


def reading_order(*texts: str) -> tuple[list[str | int] | str, ...]:
    """Sort key that reads numbers as numbers: layers.2 before layers.10 (a plain string sort
    lists layers 0, 1, 10, 11, ..., 19, 2, 20, which is hard to scan by eye). Splitting on the
    numbers puts them at the odd places, so parts at the same place compare like with like.
    The texts themselves come last, so that "layer07" and "layer7" still have one order."""
    numbered = (
        [int(part) if place % 2 else part for place, part in enumerate(_DIGITS.split(text))]
        for text in texts
    )
    return (*numbered, *texts)
