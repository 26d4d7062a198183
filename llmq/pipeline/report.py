"""What a quantization run reports: per linear, per layer, and the whole result (what
`--json` prints and `llmq.json` keeps of the layers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmq.pipeline.scaling import ScaleReport


@dataclass(frozen=True, slots=True)
class LinearReport:
    name: str
    quant: str  # e.g. "int4 g64"; "dense" when pruned alone
    weight_nrmse: float  # ||W - deq(q(W))|| / ||W||
    # ||(W - Q) X|| / ||W X|| on the calibration inputs, from their Hessian (methods that collect
    # one); for AWQ-scaled linears, of the scaled weight on the scaled inputs.
    output_error: float | None = None
    rtn_output_error: float | None = None  # the same for plain RTN of the original weight
    loss: float | None = None  # the method's own objective (GPTQ's loss)
    dampening_frac: float | None = None  # GPTQ's dampening, raised when Cholesky failed
    warning: str | None = None  # numerical trouble handled by a documented fallback
    # share of the weights stored as exactly zero (pruned, or rounded to zero), from the tensors
    # written; with their count, for the overall figure
    sparsity: float | None = None
    numel: int | None = None


@dataclass(frozen=True, slots=True)
class LayerReport:
    index: int
    # ||Y_q - Y|| / ||Y|| on the first REPORT_WINDOWS calibration windows; None: no data
    output_rel_rmse: float | None
    seconds: float
    linears: list[LinearReport]
    # The same layer and inputs with plain RTN, on the same windows.
    rtn_output_rel_rmse: float | None = None
    scales: list[ScaleReport] = field(default_factory=list)  # AWQ's folds
    # A mixture of experts: the calibration tokens the router sent to each expert (each token
    # counts for each of its top-k experts), on the float layer.
    expert_tokens: list[int] | None = None


@dataclass(slots=True)
class QuantizeResult:
    out_dir: Path
    model: str
    scheme: str
    method: str
    layers: list[LayerReport]
    ignored: list[str]
    group_size_adjustments: list[dict[str, Any]]
    calibration: dict[str, Any] | None
    fallback: dict[str, Any] | None = None  # linears a fallback scan kept in full precision
    # per loader (transformers, vllm, llmq): {"reads": bool, "why": str | None}
    loaders: dict[str, Any] = field(default_factory=dict)
    resumed_layers: int = 0
    seconds: float = 0.0
    # A layout found from the module tree (a family not in llmq's table): what it found
    discovered_layout: list[str] | None = None
    size_bytes: dict[str, int] = field(default_factory=dict)
    # pruning methods: the share of zeros written, overall and per linear (`written_sparsity`)
    sparsity: dict[str, float] | None = None
    # converted model-free (llmq.pipeline.model_free): the targets' rule, tensors, shards, threads
    model_free: dict[str, Any] | None = None
    # mixed precision: the budget, each linear's choice, predicted and written bits a weight
    mixed_precision: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["out_dir"] = str(self.out_dir)
        return data


def layer_report(raw: dict[str, Any]) -> LayerReport:
    linears = [LinearReport(**linear) for linear in raw["linears"]]
    scales = [ScaleReport(**scale) for scale in raw.get("scales", [])]
    return LayerReport(**{**raw, "linears": linears, "scales": scales})


def written_sparsity(layers: list[dict[str, Any]]) -> dict[str, float]:
    """The share of zeros in the linears written (from each layer's raw report), overall and
    per linear at the extremes: what llmq.json records and `llmq eval` shows."""
    linears = [linear for layer in layers for linear in layer["linears"]]
    zeros = sum(linear["sparsity"] * linear["numel"] for linear in linears)
    total = sum(linear["numel"] for linear in linears)
    shares = [linear["sparsity"] for linear in linears]
    return {"linears": zeros / max(total, 1), "min": min(shares), "max": max(shares)}


STARVED_SHARE = 0.1  # an expert routed fewer tokens than this share of an even split is flagged


def starved_experts(layers: list[LayerReport]) -> list[tuple[int, int, int]]:
    """(layer, expert, routed tokens) of each expert the router sent fewer than STARVED_SHARE
    of an even share of the calibration tokens: with `--moe-calibration routed` its statistics
    rest on few tokens (none: it is rounded to nearest); with `all` it is calibrated anyway,
    and the line says how much of the text ever reaches it."""
    found = []
    for layer in layers:
        counts = layer.expert_tokens or []
        even = sum(counts) / max(len(counts), 1)
        found += [(layer.index, e, n) for e, n in enumerate(counts) if n < STARVED_SHARE * even]
    return found
