"""Per-linear input statistics, accumulated over calibration batches and saved as safetensors.

Linears that read the same activations (q/k/v, gate/up) share one `InputStats` object, so a
Hessian is computed and stored once per input, not once per projection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from llmq.errors import InputError
from llmq.quant.primitives import ACCUM_DTYPE

if TYPE_CHECKING:
    from llmq.io.checkpoint import Checkpoint
    from llmq.processes import Processes

STATS_FORMAT = "llmq-calib-stats/1"
SAMPLE_STRIDE = 32  # keep every 32nd token of each batch as a sample row...
SAMPLE_ROWS = 2048  # ...up to this many (128 x 512 calibration tokens give 2048)


@dataclass(slots=True)
class InputStats:
    """Running statistics of one linear input x [tokens, in_features] (float32 accumulators)."""

    absmax: Tensor | None  # [in] max |x_j| (None when only the Hessian is collected)
    abs_sum: Tensor | None  # [in] sum |x_j| (likewise)
    num_tokens: int = 0
    hessian: Tensor | None = None  # [in, in] running mean of 2 x^T x / tokens (GPTQ's H)
    # [rows, in] every SAMPLE_STRIDE-th token, for searches and observers that need values
    # (SmoothQuant's alpha, percentile and MSE activation scales); not saved to files.
    samples: Tensor | None = None
    sq_sum: Tensor | None = None  # [in] sum x_j² (OWL's Wanda norms, when asked); not saved

    @classmethod
    def empty(
        cls,
        in_features: int,
        *,
        hessian: bool,
        device: torch.device,
        samples: bool = False,
        magnitudes: bool = True,
        norms: bool = False,
    ) -> InputStats:
        """magnitudes=False leaves absmax and abs_sum out: GPTQ reads only the Hessian, and
        |x| with its two reductions costs ~5% of a Hessian update. norms: also sum x_j²."""
        zeros = torch.zeros(in_features, dtype=ACCUM_DTYPE, device=device)
        h = torch.zeros(in_features, in_features, dtype=ACCUM_DTYPE, device=device)
        kept = zeros[:0].reshape(0, in_features) if samples else None
        return cls(
            absmax=zeros.clone() if magnitudes else None,
            abs_sum=zeros.clone() if magnitudes else None,
            hessian=h if hessian else None,
            samples=kept,
            sq_sum=zeros if norms else None,
        )

    def update(self, x: Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).to(ACCUM_DTYPE)
        n = rows.shape[0]
        if self.absmax is not None and self.abs_sum is not None:
            magnitudes = rows.abs()
            self.absmax = torch.maximum(self.absmax, magnitudes.amax(dim=0))
            self.abs_sum += magnitudes.sum(dim=0)
            del magnitudes  # before the Hessian's product: one working copy of x at a time
        if self.sq_sum is not None:
            self.sq_sum += rows.square().sum(dim=0)
        if self.hessian is not None:
            total = self.num_tokens + n
            add_gram(self.hessian, rows, beta=self.num_tokens / total, alpha=2.0 / total)
        if self.samples is not None and len(self.samples) < SAMPLE_ROWS:
            room = SAMPLE_ROWS - len(self.samples)
            self.samples = torch.cat([self.samples, rows[::SAMPLE_STRIDE][:room]])
        self.num_tokens += n

    def rescaled(self, factor: Tensor) -> InputStats:
        """The statistics of x · diag(factor) (inputs after an equivalence scaling), exactly."""

        def scaled(stat: Tensor | None) -> Tensor | None:
            return None if stat is None else stat * factor.to(stat)

        hessian = None
        if self.hessian is not None:
            across = factor.to(self.hessian)
            hessian = self.hessian * torch.outer(across, across)
        return InputStats(
            scaled(self.absmax), scaled(self.abs_sum), self.num_tokens, hessian,
            scaled(self.samples),
        )  # fmt: skip

    @property
    def mean_abs(self) -> Tensor:
        if self.abs_sum is None:
            raise ValueError("these statistics were collected for a Hessian alone")
        return self.abs_sum / max(self.num_tokens, 1)


def reduce_stats(observed: dict[str, InputStats], processes: Processes) -> dict[str, InputStats]:
    """The statistics of all processes' windows, in every process (`observed`: this process's,
    by owning linear). A linear one process saw no input for (an expert its tokens never
    reached) takes part with empty statistics; one no process saw stays absent. The Hessian is
    the token-weighted mean of the processes', reduced in float64; the samples are all
    processes' rows, in rank order."""
    if not processes.distributed:
        return observed
    shapes = {name: _shape(stats) for name, stats in observed.items()}
    everyone: dict[str, tuple[int, bool, bool, bool, bool]] = {}
    for seen in processes.gather(shapes):
        everyone.update(seen)
    tensors = (t for s in observed.values() for t in (s.hessian, s.absmax, s.sq_sum) if t is not None)  # fmt: skip
    device = next((t.device for t in tensors), torch.device("cpu"))  # NCCL reduces GPU tensors
    reduced = {}
    for name in sorted(everyone):  # the same order in every process: the collectives pair up
        features, hessian, samples, magnitudes, norms = everyone[name]
        stats = observed.get(name) or InputStats.empty(
            features, hessian=hessian, device=device, samples=samples, magnitudes=magnitudes,
            norms=norms,
        )  # fmt: skip
        reduced[name] = _reduced(stats, processes, device)
    return reduced


def _shape(stats: InputStats) -> tuple[int, bool, bool, bool, bool]:
    """What an empty stand-in for `stats` needs: in_features and which fields it holds."""
    present = next(t for t in (stats.hessian, stats.absmax, stats.sq_sum, stats.samples) if t is not None)  # fmt: skip
    return (
        present.shape[-1], stats.hessian is not None, stats.samples is not None,
        stats.absmax is not None, stats.sq_sum is not None,
    )  # fmt: skip


def _reduced(stats: InputStats, processes: Processes, device: torch.device) -> InputStats:
    counts = torch.tensor([float(stats.num_tokens)], dtype=torch.float64, device=device)
    processes.reduce(counts)
    tokens = int(counts.item())
    hessian = stats.hessian
    if hessian is not None:
        weighted = hessian.to(torch.float64) * stats.num_tokens
        processes.reduce(weighted)
        hessian = (weighted / max(tokens, 1)).to(hessian.dtype)
    for field_name, op in (("absmax", "max"), ("abs_sum", "sum"), ("sq_sum", "sum")):
        value = getattr(stats, field_name)
        if value is not None:
            processes.reduce(value, op)
    samples = stats.samples
    if samples is not None:
        rows = processes.gather(samples.cpu())
        samples = torch.cat(rows)[:SAMPLE_ROWS].to(samples.device)
    return InputStats(stats.absmax, stats.abs_sum, tokens, hessian, samples, stats.sq_sum)


def add_gram(target: Tensor, rows: Tensor, *, beta: float, alpha: float, leaf: int = 192) -> None:
    """target = beta · target + alpha · rowsᵀ rows, in place, for a symmetric `target`.

    Only the upper triangle is multiplied, then mirrored: about half the multiply-adds of a full
    product (torch exposes no syrk). On a 2-core CPU the Hessians of a layer's four inputs cost
    most of a forward pass, three quarters of it down_proj's.
    """
    target.mul_(beta)
    _add_gram_block(target, rows, alpha, 0, target.shape[0], leaf)


def _add_gram_block(
    target: Tensor, rows: Tensor, alpha: float, start: int, end: int, leaf: int
) -> None:
    """The block [start:end]² of `add_gram`, by halves: one half's columns times the other's
    fill the off-diagonal block, and each half recurses down to `leaf` columns, multiplied
    whole. The products stay large and square: 7% faster on two cores than strips of 256
    columns against all later columns (36 -> 34 ms for 2048 x 1536 rows)."""
    if end - start <= leaf:
        target[start:end, start:end].addmm_(rows[:, start:end].T, rows[:, start:end], alpha=alpha)
        return
    mid = (start + end) // 2
    target[start:mid, mid:end].addmm_(rows[:, start:mid].T, rows[:, mid:end], alpha=alpha)
    target[mid:end, start:mid] = target[start:mid, mid:end].T
    _add_gram_block(target, rows, alpha, start, mid, leaf)
    _add_gram_block(target, rows, alpha, mid, end, leaf)


@dataclass(slots=True)
class CalibStats:
    """Statistics for every quantizable linear, by module name, plus how they were collected."""

    inputs: dict[str, InputStats] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        """One safetensors file: `<linear>.absmax|mean_abs|hessian` for the first linear of each
        shared input, and the aliases of the others in the metadata."""
        from llmq.io.atomic import save_safetensors

        tensors: dict[str, Tensor] = {}
        owners: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, stats in self.inputs.items():
            owner = owners.setdefault(id(stats), name)
            if owner != name:
                aliases[name] = owner
                continue
            tensors[f"{name}.absmax"] = stats.absmax.contiguous().cpu()
            tensors[f"{name}.mean_abs"] = stats.mean_abs.contiguous().cpu()
            tensors[f"{name}.num_tokens"] = torch.tensor([stats.num_tokens], dtype=torch.int64)
            if stats.hessian is not None:
                tensors[f"{name}.hessian"] = stats.hessian.contiguous().cpu()
        metadata = {
            "format": STATS_FORMAT,
            "aliases": json.dumps(aliases),
            "metadata": json.dumps(self.metadata),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors(path, tensors, metadata)

    def input_weights(self) -> dict[str, Tensor]:
        """Per linear, how much each input channel matters: E[x_j^2] (the Hessian's diagonal, up
        to a constant) or, for statistics collected without a Hessian, mean|x_j|^2."""
        return {
            name: s.mean_abs.square() if s.hessian is None else s.hessian.diagonal().clone()
            for name, s in self.inputs.items()
        }

    @classmethod
    def load(cls, path: Path) -> CalibStats:
        from safetensors import safe_open

        from llmq.io.checkpoint import read_safetensors_header

        if not path.is_file():
            raise InputError(f"{path}: no such statistics file")
        read_safetensors_header(path)  # clear errors for truncated/corrupt files
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != STATS_FORMAT:
                raise InputError(
                    f"{path}: not an llmq statistics file", hint="create one with `llmq calibrate`"
                )
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        inputs: dict[str, InputStats] = {}
        for key in tensors:
            if key.endswith(".absmax"):
                name = key.removesuffix(".absmax")
                count = int(tensors[f"{name}.num_tokens"].item())
                inputs[name] = InputStats(
                    absmax=tensors[key],
                    abs_sum=tensors[f"{name}.mean_abs"] * count,
                    num_tokens=count,
                    hessian=tensors.get(f"{name}.hessian"),
                )
        for alias, owner in json.loads(meta.get("aliases", "{}")).items():
            inputs[alias] = inputs[owner]
        return cls(inputs=inputs, metadata=json.loads(meta.get("metadata", "{}")))


def check_stats_output(path: Path, *, overwrite: bool) -> None:
    """Refuse an existing file without `overwrite`, and even with it any file but an llmq
    statistics file: --overwrite never replaces a file llmq did not write."""
    from llmq.io.atomic import check_output_file

    check_output_file(path, overwrite=overwrite, ours=_is_stats_file, kind="a statistics file")


def _is_stats_file(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == STATS_FORMAT
    except Exception:  # not a file, not safetensors, unreadable: not ours either way
        return False


def saved_stats_bytes(ckpt: Checkpoint, *, hessian: bool) -> int:
    """About the size of the file `CalibStats.save` writes for `ckpt`: per layer, one entry
    per group of linears that read the same input (absmax and mean |x|, the [in, in] Hessian)."""
    layout = ckpt.layout
    total = 0
    for index in range(ckpt.num_layers):
        for group in layout.at(index).sequential:
            info = ckpt.tensors.get(f"{layout.layer_prefix(index)}{group[0]}.weight")
            if info is None:
                continue
            columns = info.shape[-1]
            total += 2 * columns * 4 + (columns * columns * 4 if hessian else 0)
    return total
