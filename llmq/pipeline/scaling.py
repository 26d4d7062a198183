"""Equivalence scaling of a loaded decoder layer: AWQ's and SmoothQuant's per-channel scales,
chosen on the layer's calibration statistics and folded into the modules, before any weight is
quantized.

The pairings (which norm or linear feeds which linears) come from the family table; this
module only applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from llmq.calib.stats import InputStats
from llmq.config import AWQConfig, QuantArgs
from llmq.io.layout import DecoderLayout
from llmq.quant.awq import (
    Quantizer,
    fold_into_norm,
    fold_into_rows,
    scale_columns,
    search_scales,
    weight_magnitude,
)
from llmq.quant.primitives import fake_quantize, quantize_weight, static_scale
from llmq.quant.smoothquant import AUTO_ALPHAS, ActivationQuantizer, search_smoothing


@dataclass(frozen=True, slots=True)
class ScaleReport:
    producer: str  # the norm or linear that absorbed 1/s
    alpha: float | None  # None: SmoothQuant's search left this pairing unscaled
    # 1 - error(chosen) / error(unscaled) of the consumers' outputs on the calibration data
    error_reduction: float


def rtn_quantizer(args: QuantArgs, scale_dtype: torch.dtype) -> Quantizer:
    """The quantize-dequantize the scale search scores (plain RTN, as in AWQ)."""
    return lambda weight: quantize_weight(weight, args, scale_dtype=scale_dtype).dequantize()


def search_quantizer(args: QuantArgs, scale_dtype: torch.dtype) -> Quantizer:
    """A fast stand-in for RTN in SmoothQuant's search, which quantizes every consumer once per
    alpha: float32 absmax scales per row or group (what 8-bit RTN gives up to the last code);
    other arguments use RTN itself."""
    if args.symmetric and args.strategy in ("tensor", "channel", "group"):
        proxy = args.model_copy(update={"dynamic": True})
        return lambda weight: fake_quantize(weight, proxy)
    return rtn_quantizer(args, scale_dtype)


def apply_awq(
    layer: nn.Module,
    layout: DecoderLayout,
    args: dict[str, QuantArgs],
    scale_dtypes: dict[str, torch.dtype],
    stats: dict[str, InputStats | None],
    config: AWQConfig,
) -> tuple[dict[str, InputStats | None], list[ScaleReport]]:
    """Search and fold AWQ scales for every pairing whose consumers are all being quantized
    (`args`, by name in the layer). Returns the consumers' statistics after scaling (their
    inputs are now x / s) and what was done."""
    quantizers = {name: rtn_quantizer(args[name], scale_dtypes[name]) for name in args}
    stats = dict(stats)
    reports = []
    for producer, consumers in layout.smooth:
        shared = _foldable_stats(layer, layout, producer, consumers, quantizers, stats)
        if shared is None or shared.hessian is None:
            continue
        weights = [(layer.get_submodule(name).weight.data, quantizers[name]) for name in consumers]
        magnitude = None
        if config.duo_scaling:
            magnitude = weight_magnitude(
                [(layer.get_submodule(name).weight.data, args[name]) for name in consumers]
            )
        search = search_scales(
            weights, shared.mean_abs, shared.hessian, grid=config.grid, weight_mean=magnitude
        )
        _fold(layer, layout, producer, consumers + layout.float_readers(producer), search.scales)
        rescaled = shared.rescaled(1.0 / search.scales)
        stats.update(dict.fromkeys(consumers, rescaled))
        reduction = 1.0 - search.error / search.error_unscaled if search.error_unscaled > 0 else 0.0
        reports.append(ScaleReport(producer, search.alpha, reduction))
    return stats, reports


def apply_smoothquant(
    layer: nn.Module,
    layout: DecoderLayout,
    args: dict[str, QuantArgs],
    scale_dtypes: dict[str, torch.dtype],
    input_args: dict[str, QuantArgs],
    stats: dict[str, InputStats | None],
    smooth: float | str,
) -> tuple[dict[str, InputStats | None], list[ScaleReport]]:
    """Fold SmoothQuant scales (alpha `smooth`, or "auto": searched per pairing) into the
    family's SmoothQuant pairings (`DecoderLayout.smoothing_pairs`) whose consumers all have
    quantized weights and inputs. Returns the consumers' statistics after scaling and, per
    pairing, the output error change on the sample rows."""
    quantizers = {
        name: search_quantizer(args[name], scale_dtypes[name])
        for name in args
        if name in input_args
    }
    alphas = AUTO_ALPHAS if smooth == "auto" else (float(smooth),)
    stats = dict(stats)
    reports = []
    for producer, consumers in layout.smoothing_pairs(smooth):
        shared = _foldable_stats(layer, layout, producer, consumers, quantizers, stats)
        if shared is None or shared.samples is None or len(shared.samples) == 0:
            continue
        weights = [(layer.get_submodule(name).weight.data, quantizers[name]) for name in consumers]
        search = search_smoothing(
            weights, shared.absmax, shared.samples, input_quantizer(input_args[consumers[0]]),
            alphas, keep_unsmoothed=smooth == "auto",
        )  # fmt: skip
        if search.scales is not None:
            _fold(
                layer, layout, producer, consumers + layout.float_readers(producer), search.scales
            )
            stats.update(dict.fromkeys(consumers, shared.rescaled(1.0 / search.scales)))
        reduction = 1.0 - search.error / search.error_unsmoothed if search.error_unsmoothed else 0.0
        reports.append(ScaleReport(producer, search.alpha, reduction))
    return stats, reports


def input_quantizer(args: QuantArgs) -> ActivationQuantizer:
    """Quantize-dequantize of a linear's inputs for the search: per token (group) when dynamic,
    else with the absmax static scale (NVFP4: global scale) of the scaled inputs."""
    if args.dynamic is True:
        return lambda x, _absmax: fake_quantize(x, args)
    return lambda x, absmax: fake_quantize(x, args, static_scale(absmax.max(), args).to(x.device))


def _foldable_stats(
    layer: nn.Module,
    layout: DecoderLayout,
    producer: str,
    consumers: tuple[str, ...],
    quantizers: dict[str, Quantizer],
    stats: dict[str, InputStats | None],
) -> InputStats | None:
    """The consumers' shared input statistics, or None where the pairing does not apply: an
    ignored consumer (nothing to protect) or a linear producer of another width (GQA's v_proj,
    or a fused qkv_proj whose v is narrower than q)."""
    if not all(name in quantizers for name in consumers):
        return None
    source = layer.get_submodule(producer)
    width = layer.get_submodule(consumers[0]).weight.shape[1]
    if isinstance(source, nn.Linear) and source.out_features != width * layout.parts(producer):
        return None
    return stats.get(consumers[0])


@torch.no_grad()
def _fold(
    layer: nn.Module,
    layout: DecoderLayout,
    producer: str,
    readers: tuple[str, ...],
    scales: Tensor,
) -> None:
    """Scale `producer`'s output by 1 / scales and every reader's input columns by scales. A
    linear producer's readers read its last rows: all of them, or a fused linear's last part."""
    source = layer.get_submodule(producer)
    if isinstance(source, nn.Linear):
        read = slice(source.out_features - scales.numel(), None)
        source.weight.data[read] = fold_into_rows(source.weight.data[read], scales)
        if source.bias is not None:
            source.bias.data[read] = fold_into_rows(source.bias.data[read], scales)
    else:
        source.weight.data = fold_into_norm(source.weight.data, scales, layout.norm_weight_offset)
        if getattr(source, "bias", None) is not None:  # a LayerNorm's shift scales too
            source.bias.data = fold_into_rows(source.bias.data, scales)
    for name in readers:
        module = layer.get_submodule(name)
        module.weight.data = scale_columns(module.weight.data, scales)
