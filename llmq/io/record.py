"""llmq.json: how llmq made a checkpoint, one typed record that every writer fills and every
reader reads (quantize and prune, structured pruning, distillation, `llmq verify`); written
by llmq.io.atomic's `write_record` and `add_to_record`, atomically as every output file.

Each job fills the sections it has: `recipe` (the options, as the CLI, a recipe stage and Python
give them alike), `calibration`, `structured`, `distillation`, ...; `finish_checkpoint` adds
`reference` and `files`, what `llmq verify` checks. Sections are plain JSON objects: their
contents belong to the job that writes them. A section this version does not know (a record
from a later llmq) is kept when the record is read and written again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from llmq import __version__
from llmq.errors import InputError

RECORD_FILE = "llmq.json"

Section = dict[str, Any]


@dataclass(slots=True)
class OutputRecord:
    llmq_version: str | None = __version__
    created: str | None = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
    source_model: str | None = None
    recipe: Section | None = None  # quantize, prune and structured pruning: their options
    structured: Section | None = None  # what structured pruning removed, and the budget
    calibration: Section | None = None  # the text, windows and tokens that calibrated
    loaders: Section | None = None  # which loaders read the format
    calib_stats: Section | None = None  # the statistics file a job used
    fallback: Section | None = None  # the tensors kept at higher precision, and why
    sparsity_profile: Section | None = None  # per-layer sparsities (owl, ...)
    mixed_precision: Section | None = None  # each linear's scheme under the budget, and why
    sparsity: Section | None = None  # the share of zeros written
    model_free: Section | None = None  # converted without the model: which rule chose the linears
    distillation: Section | None = None  # the training config and its summary
    reference: Section | None = None  # log-probabilities `llmq verify` compares with
    files: dict[str, str] | None = None  # each file's hash, for `llmq verify`
    later: Section = field(default_factory=dict)  # sections of a later llmq, kept as they are

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, sections in a fixed order, absent ones left out."""
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "later"}
        return {**{k: v for k, v in known.items() if v is not None}, **self.later}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OutputRecord:
        names = {f.name for f in fields(cls)} - {"later"}
        known = {k: v for k, v in data.items() if k in names}
        later = {k: v for k, v in data.items() if k not in names}
        return cls(**{"llmq_version": None, "created": None, **known}, later=later)

    @classmethod
    def read(cls, folder: Path, *, strict: bool = False) -> OutputRecord:
        """The record of the checkpoint at `folder`; an empty one where there is none or it is
        not a JSON object (another tool's checkpoint, a damaged record): a record informs
        reports but never decides whether a checkpoint can be read. `strict` (what `llmq
        verify` checks): a record that exists but cannot be read is an InputError."""
        path = folder / RECORD_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            data = {}
        except (OSError, ValueError) as exc:
            if strict:
                raise InputError(f"{path}: unreadable ({exc})") from None
            data = {}
        return cls.from_dict(data if isinstance(data, dict) else {})

    @property
    def written_by_llmq(self) -> bool:
        return self.llmq_version is not None
