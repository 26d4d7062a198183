"""`llmq prune`: a checkpoint in, the same checkpoint with pruned weights out (plain, dense
safetensors that every loader reads). The layer pipeline of `quantize`, without quantization."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from llmq.cli.console import (
    cli_errors,
    out_console,
    print_json,
    progress_bars,
    quiet_libraries,
    resume_hint_on_interrupt,
)
from llmq.cli.options import (
    CalibStatsPath,
    CalibText,
    DampeningFrac,
    Device,
    Ignore,
    JsonFlag,
    ModelArg,
    Overwrite,
    PatternOption,
    Reference,
    Resume,
    ResumeEvery,
    Seed,
    SeqLen,
    SpaceCheck,
    SparsityOption,
    SparsityProfile,
    TrueSequential,
)
from llmq.cli.quantize import render
from llmq.config import RESUME_EVERY_S
from llmq.errors import InputError
from llmq.texts import DEFAULT_CALIBRATION_TEXT


def prune(
    model: ModelArg,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output folder (a plain Hugging Face checkpoint); must not exist unless --overwrite.",
        ),
    ],
    method: Annotated[
        str,
        typer.Option(
            help="sparsegpt: GPTQ's solver chooses each block's mask from the updated weights and spreads each pruned weight over the inputs not yet visited, using each input's Hessian. wanda: drop the smallest |w|·‖x‖ in each row (no weight update). magnitude: drop the smallest |w| (no data needed)."
        ),
    ] = "sparsegpt",
    sparsity: SparsityOption = None,
    pattern: PatternOption = None,
    sparsity_profile: SparsityProfile = "uniform",
    structured: Annotated[
        bool,
        typer.Option(
            help="Remove whole MLP channels, key-value groups (with their query heads) and layers instead of single weights: a smaller dense model, the same width in every layer (give --params or the sizes below). Importance: activation norms on the calibration windows (Minitron), layers by Block Importance (ShortGPT)."
        ),
    ] = False,
    params: Annotated[
        float | None,
        typer.Option(
            help="--structured: keep about this share of the decoder's parameters, e.g. 0.75, by narrowing the MLP (Minitron: width before depth, MLP first; to a multiple of 64 channels)."
        ),
    ] = None,
    intermediate_size: Annotated[
        int | None, typer.Option(help="--structured: MLP channels to keep in every layer.")
    ] = None,
    num_kv_heads: Annotated[
        int | None,
        typer.Option(
            help="--structured: key-value groups to keep in every layer, each with its query heads (grouped-query attention stays valid)."
        ),
    ] = None,
    num_layers: Annotated[
        int | None,
        typer.Option(help="--structured: decoder layers to keep (the highest Block Importance)."),
    ] = None,
    num_heads: Annotated[
        int | None,
        typer.Option(
            help="--structured: query heads to keep, the same number in every key-value group kept (its most important ones, by the L2 norm of each head's output)."
        ),
    ] = None,
    hidden_size: Annotated[
        int | None,
        typer.Option(
            help="--structured: hidden (embedding) channels to keep, the same in every layer, the embedding, the norms and lm_head (by the L2 norm of the RMSNorm outputs). The hardest axis on quality: distill afterwards."
        ),
    ] = None,
    depth_metric: Annotated[
        str,
        typer.Option(
            help="--structured: rank layers by block (Block Importance, 1 - cos of a layer's input and output; ShortGPT) or ppl (the perplexity increase from dropping each layer alone, on the first 16 calibration windows: about layers²/2 more layer passes)."
        ),
    ] = "block",
    importance: Annotated[
        Path | None,
        typer.Option(
            help="--structured: reuse the scores a previous run saved with --save-importance (no scoring pass)."
        ),
    ] = None,
    save_importance: Annotated[
        Path | None,
        typer.Option(help="--structured: save the scores to this .safetensors file."),
    ] = None,
    evaluate: Annotated[
        bool,
        typer.Option(
            help="--structured: held-out perplexity of the source and the result in the report (`llmq eval`'s default protocol)."
        ),
    ] = True,
    sparse_format: Annotated[
        str,
        typer.Option(
            help="dense: the pruned weights as plain safetensors (loads everywhere). bitmask (compressed-tensors' sparse-bitmask) is refused: compressed-tensors 0.15+ cannot write it and transformers silently re-initialises such weights."
        ),
    ] = "dense",
    ignore: Ignore = None,
    calib_text: CalibText = DEFAULT_CALIBRATION_TEXT,
    num_samples: Annotated[
        int | None,
        typer.Option(
            help="Calibration windows. Default 128 (wanda, sparsegpt); 1 for magnitude (it needs no data: the window feeds only the per-layer output-error report)."
        ),
    ] = None,
    seq_len: SeqLen = 512,
    skip_layer_check: Annotated[
        bool,
        typer.Option(
            help="magnitude only: run no forward passes (no per-layer output error; the weights are still checked for NaN/Inf)."
        ),
    ] = False,
    seed: Seed = 0,
    calib_stats: CalibStatsPath = None,
    dampening_frac: DampeningFrac = 0.01,
    true_sequential: TrueSequential = True,
    overwrite: Overwrite = False,
    resume: Resume = False,
    resume_every: ResumeEvery = RESUME_EVERY_S,
    space_check: SpaceCheck = True,
    reference: Reference = True,
    device: Device = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Prune MODEL's decoder linears (--sparsity or --pattern), or with --structured remove whole
    MLP channels, key-value groups, hidden channels and layers, and write a plain checkpoint that transformers
    and vLLM load; llmq.json records what was removed.

    One decoder layer at a time, as `llmq quantize`: each layer sees the already-pruned
    layers' outputs, and the report compares it with the dense layer and with magnitude
    pruning. lm_head and the embeddings are never pruned. To prune and quantize in one pass,
    use `llmq quantize --method sparsegpt --sparsity 0.5`.
    """
    quiet_libraries()
    from llmq import api
    from llmq.api.quantize import check_sparse_format

    if structured:
        unstructured = {"--sparsity": sparsity, "--pattern": pattern}
        given = [name for name, value in unstructured.items() if value is not None]
        with cli_errors():
            if given:
                raise InputError(f"{given[0]}: prunes single weights; --structured removes whole channels, groups and layers")  # fmt: skip
            with progress_bars(json_out=json_out) as progress:
                result = api.prune_structured(
                    model, out, intermediate_size=intermediate_size, num_kv_heads=num_kv_heads,
                    num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, params=params, depth_metric=depth_metric, importance=importance,
                    save_importance=save_importance, calib_text=calib_text,
                    num_samples=num_samples, seq_len=seq_len, seed=seed,
                    evaluate=evaluate, overwrite=overwrite, space_check=space_check,
                    reference=reference, progress=progress, device=device,
                )  # fmt: skip
        print_json(result.to_dict()) if json_out else render_structured(result)
        return
    with cli_errors():
        check_sparse_format(sparse_format)  # before any work
        recipe = api.make_recipe(
            scheme="dense", method=method, ignore=("lm_head", *(ignore or [])),
            calib_text=calib_text, num_samples=num_samples, seq_len=seq_len, seed=seed,
            skip_layer_check=skip_layer_check, dampening_frac=dampening_frac, actorder="none",
            true_sequential=true_sequential, sparsity=sparsity, pattern=pattern,
            sparsity_profile=sparsity_profile,
        )  # fmt: skip
        with progress_bars(json_out=json_out) as progress, resume_hint_on_interrupt(out):
            result = api.quantize(
                model, out, recipe=recipe, calib_stats=calib_stats, overwrite=overwrite,
                resume=resume, resume_every_s=resume_every, space_check=space_check,
                reference=reference, progress=progress, device=device,
            )  # fmt: skip
    if json_out:
        print_json(result.to_dict())
    else:
        render(result)


def render_structured(result: Any) -> None:
    table = Table(title=f"structured pruning of {Path(result.model).name}")
    table.add_column("what")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for axis, value in result.removed.items():
        if axis == "layers":
            continue
        table.add_row(axis, str(value[0]), str(value[1]))
    params, sizes = result.parameters, result.size_bytes
    table.add_row(
        "parameters", f"{params['source'] / 1e6:.1f} M", f"{params['output'] / 1e6:.1f} M"
    )
    table.add_row("file size", f"{sizes['source'] / 1e6:.1f} MB", f"{sizes['output'] / 1e6:.1f} MB")
    if result.perplexity:
        ppl = result.perplexity
        table.add_row(
            "perplexity", f"{ppl['source']:.3f}", f"{ppl['output']:.3f} ({ppl['increase']:+.1%})"
        )
    out_console.print(table)
    if result.removed["layers"]:
        out_console.print(f"layers removed: {', '.join(map(str, result.removed['layers']))}")
    if result.perplexity:
        p = result.perplexity["protocol"]
        out_console.print(
            f"perplexity protocol: {p['text']}, {p['windows']} x {p['seq_len']} tokens, BOS {'yes' if p['bos'] else 'no'}, {p['dtype']}"
        )
    out_console.print(
        f"wrote {result.out_dir} in {result.seconds:.1f} s (importance: {result.importance})"
    )
