"""What `llmq quantize` (and `llmq prune`, which shares the layer pipeline) prints: the
per-layer report and the lines under it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.table import Table

from llmq.cli.console import counted, labelled, out_console


def render(result: Any) -> None:
    if result.model_free:
        _print_model_free(result)
    else:
        _print_layer_table(result)
    _print_notes(result)


def _print_model_free(result: Any) -> None:
    done = result.model_free
    source = result.size_bytes["source"]
    out_console.print(
        f"{result.scheme} ({result.method}) converted model-free: "
        f"{counted(done['quantized'], 'linear')} quantized ({done['targets']}), "
        f"{counted(done['shards'], 'shard')} on {counted(done['workers'], 'thread')}, "
        f"{source / 1e9 / max(done['seconds'], 1e-9):.2f} GB/s of source; no per-layer output "
        "check (--no-model-free runs the layer pipeline, which measures it)",
        soft_wrap=True,
    )


def _print_layer_table(result: Any) -> None:
    compare = any(layer.rtn_output_rel_rmse is not None for layer in result.layers)
    baseline = "magnitude" if result.scheme == "DENSE" else "RTN"  # pruning alone, quantizing
    pruning_only = result.scheme == "DENSE"
    what = f"{result.method} pruning" if pruning_only else f"{result.scheme} ({result.method})"
    table = Table(title=f"{what} per-layer report")
    table.add_column("layer", justify="right")
    table.add_column("output rel. RMSE", justify="right")
    if compare:
        table.add_column(f"with {baseline}", justify="right")
        table.add_column(f"worst linear: output error ({baseline})")
    else:
        table.add_column("worst linear (weight NRMSE)")
    pruned = result.sparsity is not None
    if pruned:
        table.add_column("sparsity", justify="right")
    table.add_column("seconds", justify="right")
    for layer in result.layers:
        cells = [str(layer.index), _number(layer.output_rel_rmse)]
        if compare:
            cells += [_number(layer.rtn_output_rel_rmse), _worst_output(layer.linears)]
        else:
            cells.append(_worst_weight(layer.linears))
        if pruned:
            zeros = sum(linear.sparsity * linear.numel for linear in layer.linears)
            cells.append(f"{zeros / max(sum(linear.numel for linear in layer.linears), 1):.1%}")
        table.add_row(*cells, f"{layer.seconds:.1f}")
    out_console.print(table)


def _print_notes(result: Any) -> None:
    """Warnings, adjustments and what was kept, written and where."""
    for layer in result.layers:
        for linear in layer.linears:
            if linear.warning:
                out_console.print(f"warning: {linear.name}: {linear.warning}")
    adjusted = Counter(
        (a["requested"], a["used"], a["in_features"]) for a in result.group_size_adjustments
    )
    for (requested, used, in_features), count in sorted(adjusted.items(), key=str):
        used_text = "per-channel" if used is None else f"{used}"
        out_console.print(
            f"group size (block width) {requested} does not divide in_features {in_features}: "
            f"{counted(count, 'linear')} use {used_text} (own config group)"
        )
    if result.discovered_layout:
        out_console.print("layout found from the module tree (the family is not in llmq's table):")
        for line in result.discovered_layout:
            out_console.print(f"  {line}")
    _print_scaling(result.layers)
    _print_mixed(result.mixed_precision)
    _print_expert_coverage(result.layers)
    if result.fallback:
        kept = result.fallback["kept"]
        out_console.print(
            f"fallback ({result.fallback['report']}, {result.fallback['scheme']}): kept "
            f"{counted(len(kept), 'flagged linear')} in full precision{': ' if kept else ''}"
            + ", ".join(kept)
        )
    if result.resumed_layers:
        unit = "finished shard" if result.model_free else "finished layer"
        out_console.print(f"resumed after {counted(result.resumed_layers, unit)}")
    _print_sparsity(result)
    if result.scheme != "DENSE":  # a pruned checkpoint is plain: every loader but llmq's reads it
        _print_loaders(result)
    sizes = result.size_bytes
    kept = "left unpruned" if result.scheme == "DENSE" else "kept in full precision"
    out_console.print(
        f"wrote {result.out_dir} ({sizes['output'] / 1e6:.1f} MB, source {sizes['source'] / 1e6:.1f} MB) "
        f"in {result.seconds:.1f} s; {kept}: {counted(len(result.ignored), 'linear')}"
    )


def _print_mixed(mixed: dict[str, Any] | None) -> None:
    """Mixed precision: each candidate's share of the linears and weights, then the budget with
    the bits predicted and counted from the written files."""
    if mixed is None:
        return
    table = Table(title=f"mixed precision ({mixed['sensitivity']} sensitivity)")
    for column in ("candidate", "linears", "share of weights"):
        table.add_column(column, justify="left" if column == "candidate" else "right")
    linears = mixed["linears"].values()
    total = sum(entry["weights"] for entry in linears)
    for candidate in mixed["candidates"]:
        chosen = [entry for entry in linears if entry["candidate"] == candidate]
        share = sum(entry["weights"] for entry in chosen) / max(total, 1)
        table.add_row(candidate, str(len(chosen)), f"{share:.1%}")
    out_console.print(table)
    budget = (
        f"{mixed['target_bits']:g} bits a weight" if "target_bits" in mixed
        else f"{mixed['max_size']} bytes written"
    )  # fmt: skip
    tensors = f"; {mixed['written_bytes']} bytes of tensors" if "written_bytes" in mixed else ""
    out_console.print(
        f"budget {budget}: the decoder's linears store {mixed['written_bits']:.4f} bits a weight "
        f"as written (predicted {mixed['predicted_bits']:.4f}){tensors}; predicted damage "
        f"{mixed['predicted_damage']:.4g}"
    )


def _print_sparsity(result: Any) -> None:
    """Pruning methods: the share of zeros in the linears, as written."""
    if result.sparsity is None:
        return
    which = "pruned" if result.scheme == "DENSE" else "quantized"
    shares = result.sparsity
    out_console.print(
        f"sparsity of the {which} linears, as written: {shares['linears']:.2%} "
        f"(per linear {shares['min']:.2%} to {shares['max']:.2%})"
    )


def _print_loaders(result: Any) -> None:
    """Which loaders read the checkpoint, and for the others why not and what to use."""
    readers = [name for name, support in result.loaders.items() if support["reads"]]
    for name, support in result.loaders.items():
        if not support["reads"]:
            out_console.print(
                labelled("note:", "bold yellow", f"plain {name} cannot load this checkpoint: "
                f"{support['why']}; load it with {' or '.join(readers)} "
                "(llmq.load_quantized), and check it with `llmq verify`"),
                soft_wrap=True,
            )  # fmt: skip


def _print_scaling(layers: list[Any]) -> None:
    """One line on the AWQ / SmoothQuant folds: how many pairings were scaled, with which
    alphas, and the median change of their output error on the calibration data."""
    reports = [scale for layer in layers for scale in layer.scales]
    if not reports:
        return
    scaled = [r for r in reports if r.alpha is not None]
    alphas = Counter(r.alpha for r in scaled)
    reductions = sorted(r.error_reduction for r in reports)
    out_console.print(
        f"equivalence scaling: {len(scaled)} of {counted(len(reports), 'norm/linear pairing')} scaled "
        f"(alpha: {', '.join(f'{a:g} x{n}' for a, n in sorted(alphas.items()))}); median "
        f"output error reduction {reductions[len(reductions) // 2]:.1%}"
    )


def _print_expert_coverage(layers: list[Any]) -> None:
    """Mixtures of experts: the calibration tokens routed to each expert, their range over the
    model, and every expert routed too few of them."""
    counts = [n for layer in layers for n in layer.expert_tokens or []]
    if not counts:
        return
    from llmq.pipeline.report import STARVED_SHARE, starved_experts  # torch: not for --help

    starved = starved_experts(layers)
    out_console.print(
        f"experts: {min(counts)} to {max(counts)} calibration tokens routed to each; "
        f"{counted(len(starved), 'expert')} under {STARVED_SHARE:.0%} of an even share"
    )
    for index, expert, tokens in starved:
        out_console.print(
            f"warning: layer {index} expert {expert}: {counted(tokens, 'token')} routed"
        )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _worst_weight(linears: list[Any]) -> str:
    worst = max(linears, key=lambda linear: linear.weight_nrmse, default=None)
    return "-" if worst is None else f"{_short(worst.name)} {worst.weight_nrmse:.4f}"


def _worst_output(linears: list[Any]) -> str:
    measured = [linear for linear in linears if linear.output_error is not None]
    worst = max(measured, key=lambda linear: linear.output_error, default=None)
    if worst is None:
        return "-"
    return f"{_short(worst.name)} {worst.output_error:.4f} ({_number(worst.rtn_output_error)})"


def render_gguf(result: Any) -> None:
    """A GGUF export: the tensors per type, the worst tensors' error, size and time."""
    table = Table(title=f"GGUF {result.scheme}: tensors per type")
    table.add_column("type")
    table.add_column("tensors", justify="right")
    for name, count in sorted(result.types.items()):
        table.add_row(name, str(count))
    out_console.print(table)
    worst = ", ".join(f"{t['name']} {t['relative_rmse']:.4f}" for t in result.worst_tensors[:3])
    size = result.size_bytes
    share = size["output"] / max(size["source"], 1)
    for label, text in (
        ("highest weight rel. RMSE:", worst or "-"),
        ("importance matrix:", result.importance or "none (data-free)"),
        ("size:", f"{size['output'] / 1e6:.1f} MB ({share:.1%} of the source)"),
        ("wrote:", f"{result.out} in {result.seconds:.1f} s"),
    ):
        out_console.print(labelled(label, "bold", text), soft_wrap=True)
    _print_mixed(result.mixed_precision)
