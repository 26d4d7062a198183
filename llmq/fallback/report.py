"""What a fallback scan found, in one versioned JSON schema that `quantize --fallback` reads back,
plus CSV, Markdown and a heat-map picture of the same rows.

JSON schema `llmq.fallback-scan`, version 1 (stable: fields are only ever added):
  schema, version, llmq_version, root, scheme, args (QuantArgs), thresholds {nrmse, ratio, error_share},
  sample, calib_stats, seconds, workers, bytes_scanned,
  tensors: [{name, file, dtype, shape, numel, kind, layer, min, max, absmax, mean, std, q1, q3,
             spread_ratio, tail_share, nan, inf, nrmse, range_nrmse, weighted_nrmse, output_error,
             error_share, sampled, flagged, reasons}],
  flagged: [tensor names], skipped: [{name, file, dtype, shape, reason}],
  failed: [{file, error}], summary: [{kind, tensors, flagged, nrmse_mean, nrmse_max, ratio_max}]
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmq.config import QuantArgs
from llmq.errors import InputError

if TYPE_CHECKING:
    from llmq.fallback.summary import TensorStats

SCHEMA = "llmq.fallback-scan"
SCHEMA_VERSION = 1

_KINDS = (
    ("q", r"q_proj"), ("k", r"k_proj"), ("v", r"v_proj"), ("qkv", r"qkv_proj|query_key_value|c_attn"),
    ("o", r"o_proj|out_proj|dense|c_proj"), ("gate", r"gate_proj|w1"), ("up", r"up_proj|w3"),
    ("gate_up", r"gate_up_proj"), ("down", r"down_proj|w2"), ("embed", r"embed_tokens|wte|word_embeddings"),
    ("lm_head", r"lm_head"), ("norm", r"norm|ln_"),
)  # fmt: skip
KIND_ORDER = [kind for kind, _ in _KINDS] + ["other"]


def tensor_kind(name: str) -> str:
    """q/k/v/o/gate/up/down/embed/lm_head/norm/other, from the tensor's module name."""
    module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    last = module.rsplit(".", 1)[-1]
    for kind, pattern in _KINDS:
        if re.fullmatch(pattern, last) or (kind in ("embed", "lm_head", "norm") and re.search(pattern, last)):  # fmt: skip
            return kind
    return "other"


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to (the first numeric name component)."""
    match = re.search(r"\.(\d+)\.", f".{name}")
    return int(match.group(1)) if match else None


@dataclass(slots=True)
class TensorScan:
    """One scanned tensor: where it is, its statistics, and why it is flagged."""

    name: str
    file: str
    dtype: str
    shape: list[int]
    stats: TensorStats
    sampled: bool = False
    reasons: list[str] = field(default_factory=list)  # why it is flagged; empty: not flagged
    # with calibration statistics: this linear's share of all scanned linears' output error
    error_share: float | None = None

    @property
    def score(self) -> float | None:
        """What flags and ranks the tensor: its share of the estimated output error when
        calibration statistics cover it, else its NRMSE."""
        return self.stats.nrmse if self.error_share is None else self.error_share

    @property
    def flagged(self) -> bool:
        return bool(self.reasons)

    @property
    def kind(self) -> str:
        return tensor_kind(self.name)

    @property
    def layer(self) -> int | None:
        return layer_index(self.name)

    def to_dict(self) -> dict[str, Any]:
        """One flat JSON object (schema above)."""
        return {
            "name": self.name, "file": self.file, "dtype": self.dtype, "shape": self.shape,
            **asdict(self.stats), "kind": self.kind, "layer": self.layer,
            "spread_ratio": _finite_or_none(self.stats.spread_ratio), "sampled": self.sampled,
            "error_share": self.error_share, "flagged": self.flagged, "reasons": self.reasons,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorScan:
        from llmq.fallback.summary import TensorStats

        stats = TensorStats(**{f.name: data[f.name] for f in fields(TensorStats)})
        return cls(data["name"], data["file"], data["dtype"], data["shape"], stats,
                   data["sampled"], data["reasons"], data["error_share"])  # fmt: skip


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class Skipped:
    name: str
    file: str
    dtype: str
    shape: list[int]
    reason: str


@dataclass(slots=True)
class ScanReport:
    root: str
    scheme: str
    args: QuantArgs
    nrmse_threshold: float
    ratio_threshold: float | None
    share_threshold: float | None  # with calibration statistics only
    sample: int | None
    tensors: list[TensorScan]
    skipped: list[Skipped]
    failed: dict[str, str]  # file -> why it could not be scanned
    seconds: float
    workers: int
    calib_stats: str | None = None  # statistics file that weighted the linears' errors

    @property
    def flagged(self) -> list[TensorScan]:
        return [t for t in self.tensors if t.flagged]

    @property
    def rule(self) -> str:
        """When a tensor is flagged, in words."""
        parts = []
        if self.share_threshold is not None:
            parts.append(f"output error share > {self.share_threshold:g} (calibrated linears)")
        parts.append(f"NRMSE > {self.nrmse_threshold:g}")
        if self.ratio_threshold is not None:
            parts.append(f"spread ratio > {self.ratio_threshold:g}")
        return " or ".join([*parts, "NaN/Inf"])

    @property
    def bytes_scanned(self) -> int:
        from llmq.io.checkpoint import DTYPE_BYTES

        return sum(t.stats.numel * DTYPE_BYTES[t.dtype] for t in self.tensors)

    def by_score(self) -> list[TensorScan]:
        """Worst first: tensors without a score (non-finite, 1-D under a row scheme), then the
        calibrated linears by error share, then the rest by NRMSE."""

        def key(t: TensorScan) -> tuple[int, float]:
            if t.score is None:
                return (0, 0.0)
            return (1 if t.error_share is not None else 2, -t.score)

        return sorted(self.tensors, key=key)

    def summary(self) -> list[dict[str, Any]]:
        """Per layer type: how many tensors, how many flagged, mean and worst NRMSE and ratio."""
        rows = []
        for kind in KIND_ORDER:
            members = [t for t in self.tensors if t.kind == kind]
            if not members:
                continue
            errors = [t.stats.nrmse for t in members if t.stats.nrmse is not None]
            rows.append({
                "kind": kind,
                "tensors": len(members),
                "flagged": sum(t.flagged for t in members),
                "nrmse_mean": sum(errors) / len(errors) if errors else None,
                "nrmse_max": max(errors) if errors else None,
                "ratio_max": _finite_or_none(max(t.stats.spread_ratio for t in members)),
            })  # fmt: skip
        return rows

    def flagged_modules(self) -> list[str]:
        """Module names of the flagged `.weight` tensors: what `quantize --fallback` keeps."""
        return [t.name.removesuffix(".weight") for t in self.flagged if t.name.endswith(".weight")]

    def to_dict(self) -> dict[str, Any]:
        from llmq import __version__

        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "llmq_version": __version__,
            "root": self.root,
            "scheme": self.scheme,
            "args": self.args.model_dump(),
            "thresholds": {
                "nrmse": self.nrmse_threshold,
                "ratio": self.ratio_threshold,
                "error_share": self.share_threshold,
            },
            "sample": self.sample,
            "calib_stats": self.calib_stats,
            "seconds": self.seconds,
            "workers": self.workers,
            "bytes_scanned": self.bytes_scanned,
            "tensors": [t.to_dict() for t in self.tensors],
            "flagged": [t.name for t in self.flagged],
            "skipped": [asdict(s) for s in self.skipped],
            "failed": [{"file": f, "error": e} for f, e in sorted(self.failed.items())],
            "summary": self.summary(),
        }

    @classmethod
    def load(cls, path: Path) -> ScanReport:
        """Read a report written by `fallback-scan --report` (or its --json output)."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise InputError(f"{path}: no such report file") from None
        except (OSError, ValueError) as exc:
            raise InputError(f"{path}: not a fallback-scan JSON report ({exc})") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise InputError(
                f"{path}: not a fallback-scan report (schema is not {SCHEMA!r})",
                hint="write one with: llmq fallback-scan MODEL --report scan.json",
            )
        if data.get("version") != SCHEMA_VERSION:
            raise InputError(
                f"{path}: report version {data.get('version')!r}; this llmq reads {SCHEMA_VERSION}"
            )
        try:
            return cls._from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path}: malformed fallback-scan report ({exc})") from None

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> ScanReport:
        return cls(
            root=data["root"],
            scheme=data["scheme"],
            args=QuantArgs(**data["args"]),
            nrmse_threshold=data["thresholds"]["nrmse"],
            ratio_threshold=data["thresholds"]["ratio"],
            share_threshold=data["thresholds"]["error_share"],
            sample=data["sample"],
            tensors=[TensorScan.from_dict(t) for t in data["tensors"]],
            skipped=[Skipped(**s) for s in data["skipped"]],
            failed={f["file"]: f["error"] for f in data["failed"]},
            seconds=data["seconds"],
            workers=data["workers"],
            calib_stats=data.get("calib_stats"),
        )


_CSV_COLUMNS = ("name", "file", "kind", "layer", "dtype", "shape", "numel", "nrmse", "error_share", "weighted_nrmse", "range_nrmse",
                "spread_ratio", "absmax", "min", "max", "mean", "std", "q1", "q3", "tail_share",
                "nan", "inf", "sampled", "flagged", "reasons")  # fmt: skip


def write_csv(report: ScanReport, path: Path) -> None:
    """One row per scanned tensor, worst NRMSE first."""
    import csv
    import io

    from llmq.io.atomic import write_text

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(_CSV_COLUMNS)
    for scan in report.by_score():
        row = scan.to_dict()
        row["shape"] = "x".join(map(str, scan.shape))
        row["reasons"] = "; ".join(scan.reasons)
        writer.writerow(["" if row[c] is None else row[c] for c in _CSV_COLUMNS])
    write_text(path, buffer.getvalue())


def write_markdown(report: ScanReport, path: Path, *, top: int) -> None:
    """A summary per layer type and the `top` worst tensors, as Markdown tables."""
    from llmq.io.atomic import write_text

    lines = [
        f"# fallback-scan: {report.root}",
        "",
        f"Scheme {report.scheme} ({report.args.label}); flagged when {report.rule}"
        + f". {len(report.tensors)} tensors scanned, {len(report.flagged)} flagged, "
        f"{len(report.skipped)} skipped, {len(report.failed)} files failed.",
        "",
        "| kind | tensors | flagged | mean NRMSE | worst NRMSE | worst ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in report.summary():
        lines.append(
            f"| {row['kind']} | {row['tensors']} | {row['flagged']} | {_num(row['nrmse_mean'])} "
            f"| {_num(row['nrmse_max'])} | {_num(row['ratio_max'])} |"
        )
    lines += ["", "| tensor | shape | dtype | NRMSE | ratio | absmax | flagged |", "|---|---|---|---:|---:|---:|---|"]  # fmt: skip
    for scan in report.by_score()[:top]:
        lines.append(
            f"| {scan.name} | {'x'.join(map(str, scan.shape))} | {scan.dtype} | "
            f"{_num(scan.score)} | {_num(scan.stats.spread_ratio)} | {_num(scan.stats.absmax)} | "
            f"{'; '.join(scan.reasons) or 'no'} |"
        )
    write_text(path, "\n".join(lines) + "\n")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


Grid = list[list[Any]]


def heatmap_grid(report: ScanReport) -> tuple[list[int], list[str], Grid, Grid]:
    """Layers (rows) x layer types (columns): the worst score in each cell, and whether a tensor
    of the cell is flagged."""
    cells: dict[tuple[int, str], float] = {}
    flagged: set[tuple[int, str]] = set()
    for scan in report.tensors:
        if scan.layer is None or scan.score is None or scan.kind in ("norm", "other"):
            continue
        key = (scan.layer, scan.kind)
        cells[key] = max(cells.get(key, 0.0), scan.score)
        if scan.flagged:
            flagged.add(key)
    layers = sorted({layer for layer, _ in cells})
    kinds = [k for k in KIND_ORDER if any(kind == k for _, kind in cells)]
    grid = [[cells.get((layer, k)) for k in kinds] for layer in layers]
    return layers, kinds, grid, [[(layer, k) in flagged for k in kinds] for layer in layers]


def write_plot(report: ScanReport, path: Path) -> None:
    """A heat map of NRMSE per decoder layer and projection, flagged cells outlined."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(
            "--plot needs matplotlib", hint="pip install 'llmq[plot]' (or matplotlib)"
        ) from None
    from llmq.io.atomic import partial_file

    layers, kinds, grid, flagged = heatmap_grid(report)
    if not layers:
        raise InputError("--plot: no tensor with a layer number and an NRMSE to draw")
    values = [[math.nan if v is None else v for v in row] for row in grid]
    figure, axes = plt.subplots(figsize=(1.1 * len(kinds) + 2.5, 0.22 * len(layers) + 1.8))
    image = axes.imshow(values, aspect="auto", cmap="magma_r", interpolation="nearest")
    axes.set_xticks(range(len(kinds)), kinds)
    axes.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    axes.set_xlabel("projection")
    axes.set_ylabel("layer")
    score = "NRMSE" if report.share_threshold is None else "output error share"
    axes.set_title(f"{score} under {report.args.label} (outlined: flagged)")
    for row, layer_values in enumerate(flagged):
        for column, value in enumerate(layer_values):
            if value:
                axes.add_patch(plt.Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="cyan", linewidth=1.5))  # fmt: skip
    figure.colorbar(image, ax=axes, label=score)
    figure.tight_layout()
    with partial_file(path) as partial:
        figure.savefig(partial, format="png", dpi=110)
    plt.close(figure)
