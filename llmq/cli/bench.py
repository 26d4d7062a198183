"""`llmq bench`: quantized kernels against the same weights in 16 bits, per layer shape and end
to end, in one run."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

import typer
from rich.table import Table

from llmq.cli.console import (
    cli_errors,
    err_console,
    labelled,
    out_console,
    print_json,
    progress_bars,
    quiet_libraries,
)
from llmq.cli.options import Device, Dtype, JsonFlag, Kernels, names, renamed
from llmq.errors import InputError


def _int_list(values: list[str] | None, option: str) -> list[int] | None:
    if not values:
        return None
    try:
        return [int(part) for part in names(values)]
    except ValueError:
        raise InputError(f"{option} {','.join(values)!r}: expected comma-separated integers") from None  # fmt: skip


def bench(
    model: Annotated[
        str | None,
        typer.Argument(
            help="Quantized checkpoint folder (omit it to time --shapes).",
        ),
    ] = None,
    shapes: Annotated[
        list[str] | None,
        typer.Option(
            metavar="LIST",
            help="MxNxK products to time on synthetic weights, e.g. 1x4096x4096 (commas or "
            "repeat).",
        ),
    ] = None,
    scheme: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="Scheme of the synthetic weights for --shapes: w4a16, w8a8 or fp8.",
        ),
    ] = "w4a16",
    batch_size: Annotated[
        list[str] | None,
        typer.Option(
            *renamed("--batch-size", "--batch"),
            metavar="LIST",
            help="M (tokens per call) to time each layer shape at (commas or repeat).",
        ),
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Prefill length of the end-to-end run (default 256 on a GPU, 32 on the CPU).",
        ),
    ] = None,
    new_tokens: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Tokens decoded greedily at batch 1 (default 64 on a GPU, 8 on the CPU).",
        ),
    ] = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    kernels: Kernels = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Time a quantized checkpoint against its 16-bit twin.

    Per layer shape (speedup and fraction of the memory roofline) and end to end (prefill,
    batch-1 decode); --shapes times synthetic layers instead. The default --batch-size is
    1,16,256 on a GPU and 1,16 on the CPU. See docs/kernels.md.
    """
    quiet_libraries()
    from llmq import api

    with cli_errors():
        shape_list = names(shapes) or None
        with progress_bars(json_out=json_out) as progress:
            report = api.bench(
                model,
                shapes=shape_list,
                scheme=scheme,
                batch_sizes=_int_list(batch_size, "--batch-size"),
                prompt_tokens=prompt_tokens,
                new_tokens=new_tokens,
                device=None if device == "auto" else device,
                dtype=dtype,
                kernels=kernels,
                progress=progress,
            )
    if json_out:
        print_json(_to_dict(report))
    else:
        render(report)


def _to_dict(report: Any) -> dict[str, Any]:
    data = asdict(report)
    if report.end_to_end is not None:
        data["end_to_end"]["decode_speedup"] = report.end_to_end.decode_speedup
        data["end_to_end"]["prefill_speedup"] = report.end_to_end.prefill_speedup
        data["end_to_end"]["graph_decode_speedup"] = report.end_to_end.graph_decode_speedup
    return data


def render(report: Any) -> None:
    if report.note:
        err_console.print(labelled("note:", "yellow", report.note))
    if report.load_seconds is not None:
        out_console.print(f"loaded onto the kernels in {report.load_seconds:.2f} s")
    table = Table(title=f"layer shapes on {report.device} ({report.kernels} kernels)")
    table.add_column("kernel", no_wrap=True)
    table.add_column("MxNxK", justify="right", no_wrap=True)
    for column in ("layers", "llmq us", f"{report.dense_dtype} us"):
        table.add_column(column, justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("roofline", justify="right")
    for row in report.shapes:
        table.add_row(
            row.kernel, row.shape, str(row.layers or "-"), f"{row.quantized_us:.1f}",
            f"{row.dense_us:.1f}", f"{row.speedup:.2f}x", f"{row.roofline:.0%}",
        )  # fmt: skip
    out_console.print(table)
    out_console.print(
        f"roofline: bytes a call must move (weights, scales, activations) / time, over the "
        f"read bandwidth measured in this run ({report.read_bandwidth_gbs:.0f} GB/s)"
    )
    e2e = report.end_to_end
    if e2e is None:
        return
    table = Table(title="end to end, batch 1")
    for column in ("", "quantized tokens/s", f"{report.dense_dtype} tokens/s", "speedup"):
        table.add_column(column, justify="right")
    table.add_row(
        f"prefill ({e2e.prompt_tokens} tokens)", f"{e2e.quantized_prefill_tps:.1f}",
        f"{e2e.dense_prefill_tps:.1f}", f"{e2e.prefill_speedup:.2f}x",
    )  # fmt: skip
    table.add_row(
        f"decode ({e2e.new_tokens} tokens)", f"{e2e.quantized_decode_tps:.1f}",
        f"{e2e.dense_decode_tps:.1f}", f"{e2e.decode_speedup:.2f}x",
    )  # fmt: skip
    if e2e.graph_decode_speedup is not None:
        table.add_row(
            "decode, CUDA graph", f"{e2e.quantized_graph_decode_tps:.1f}",
            f"{e2e.dense_graph_decode_tps:.1f}", f"{e2e.graph_decode_speedup:.2f}x",
        )  # fmt: skip
    out_console.print(table)
    if e2e.graph_note:
        err_console.print(labelled("note:", "yellow", e2e.graph_note))
