"""`llmq fallback-scan`: which tensors will not survive quantization, from the files alone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from llmq.cli.console import (
    cli_errors,
    counted,
    out_console,
    print_error,
    print_json,
    progress_bars,
    quiet_libraries,
)
from llmq.cli.options import OUTPUT, RUN, SCHEME, JsonFlag, fraction, renamed
from llmq.config import SCAN_RATIO_THRESHOLD, SCAN_SCHEME, SCAN_SHARE_THRESHOLD
from llmq.errors import InputError

FLAGGING, TENSORS = "Flagging", "Tensors"
_OUTPUT_SUFFIXES = {"--report": ".json", "--csv": ".csv", "--markdown": ".md", "--plot": ".png"}


def fallback_scan(
    path: Annotated[
        str,
        typer.Argument(
            help="A folder (searched recursively), a .safetensors file, or a built-in model name.",
        ),
    ],
    scheme: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="Quantization to simulate: int8-tensor, fp8-tensor, or a quantize preset (w4a16, "
            "...).",
            rich_help_panel=SCHEME,
        ),
    ] = SCAN_SCHEME,
    group_size: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Override the scheme's group size: -1 (per channel) or a power of two >= 16.",
            rich_help_panel=SCHEME,
        ),
    ] = None,
    nrmse_threshold: Annotated[
        float | None,
        typer.Option(
            metavar="X",
            parser=fraction("--nrmse-threshold"),
            help="Flag tensors whose NRMSE exceeds this (default: by scheme).",
            rich_help_panel=FLAGGING,
        ),
    ] = None,
    ratio_threshold: Annotated[
        float,
        typer.Option(
            metavar="X",
            help="Flag tensors whose spread ratio (range / interquartile range) exceeds this; inf: "
            "off.",
            rich_help_panel=FLAGGING,
        ),
    ] = SCAN_RATIO_THRESHOLD,
    error_share_threshold: Annotated[
        float | None,
        typer.Option(
            metavar="X",
            parser=fraction("--error-share-threshold"),
            help="With --calib-stats: flag linears above this share of the output error (0.05).",
            rich_help_panel=FLAGGING,
        ),
    ] = None,
    top: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="Rows of the worst-NRMSE table (and --markdown).",
            rich_help_panel=OUTPUT,
        ),
    ] = 20,
    include: Annotated[
        str | None,
        typer.Option(
            metavar="REGEX",
            help="Scan only tensors whose name matches this regex (searched anywhere).",
            rich_help_panel=TENSORS,
        ),
    ] = None,
    exclude: Annotated[
        str | None,
        typer.Option(
            metavar="REGEX",
            help="Skip tensors whose name matches this regex.",
            rich_help_panel=TENSORS,
        ),
    ] = None,
    jobs: Annotated[
        int,
        typer.Option(
            *renamed("--jobs", "--workers"),
            "-j",
            metavar="N",
            help="Tensors scanned in parallel (threads).",
            rich_help_panel=RUN,
        ),
    ] = 2,
    sample: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Approximate from about N values per tensor (default: every value, exact).",
            rich_help_panel=TENSORS,
        ),
    ] = None,
    calib_stats: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Statistics from llmq calibrate: also flag by output error, Σⱼ ||ΔW:ⱼ||² E[xⱼ²].",
            rich_help_panel=FLAGGING,
        ),
    ] = None,
    report: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Write the JSON report here (what llmq quantize --fallback reads).",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    csv: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Write one CSV row per tensor here.",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    markdown: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Write the summary and the worst tensors as Markdown here.",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Write a heat map of NRMSE per layer and projection here (.png).",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    fail_on_flagged: Annotated[
        bool,
        typer.Option(
            "--fail-on-flagged",
            help="Exit 1 when any tensor is flagged (for CI).",
            rich_help_panel=FLAGGING,
        ),
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Find the tensors that will not survive quantization.

    Exact statistics from the files alone, for every float tensor: the NRMSE of a simulated
    quantize-dequantize, the spread ratio, quartiles, absmax, the share of values beyond 6
    standard deviations, NaN/Inf counts. Integer (packed) tensors are listed as skipped. Exit
    codes: 0 ok, 1 flagged tensors with --fail-on-flagged, 2 bad input or a file that could not
    be read (the other files are still scanned). See docs/fallback-scan.md.
    """
    quiet_libraries()
    from llmq import api
    from llmq.io.atomic import claim_outputs

    outputs = {"--report": report, "--csv": csv, "--markdown": markdown, "--plot": plot}
    with cli_errors():
        _check_outputs(outputs)
        if top < 1:
            raise InputError(f"--top {top}: must be >= 1")
        if error_share_threshold is not None and calib_stats is None:
            raise InputError("--error-share-threshold flags by estimated output error: give --calib-stats")  # fmt: skip
        # One run at a time writes each report file, claimed before the scan starts.
        inputs = [("scanned path", path), ("statistics file", calib_stats)]
        with claim_outputs([p for p in outputs.values() if p is not None], inputs=inputs):
            with progress_bars(json_out=json_out) as progress:
                result = api.fallback_scan(
                    path, scheme=scheme, group_size=group_size, nrmse_threshold=nrmse_threshold,
                    ratio_threshold=None if ratio_threshold == float("inf") else ratio_threshold,
                    include=include, exclude=exclude, workers=jobs, sample=sample,
                    calib_stats=calib_stats,
                    error_share_threshold=SCAN_SHARE_THRESHOLD if error_share_threshold is None else error_share_threshold,
                    progress=progress,
                )  # fmt: skip
            _write_outputs(result, outputs, top)
    if json_out:
        print_json(result.to_dict())
    else:
        render(result, top)
    for file, error in sorted(result.failed.items()):
        print_error(f"{file}: {error}")
    if result.failed:
        raise typer.Exit(2)
    if fail_on_flagged and result.flagged:
        raise typer.Exit(1)


def _check_outputs(outputs: dict[str, Path | None]) -> None:
    """Output files must have their format's suffix (so a scanned .safetensors is never a
    target) and a folder to go in."""
    for option, path in outputs.items():
        if path is None:
            continue
        if path.suffix.lower() != _OUTPUT_SUFFIXES[option]:
            raise InputError(f"{option} {path}: expected a {_OUTPUT_SUFFIXES[option]} file")
        if not path.parent.is_dir():
            raise InputError(f"{option} {path}: folder {path.parent} does not exist")


def _write_outputs(result: Any, outputs: dict[str, Path | None], top: int) -> None:
    from llmq.fallback.report import write_csv, write_markdown, write_plot
    from llmq.io.atomic import write_json

    if outputs["--report"]:
        write_json(outputs["--report"], result.to_dict())
    if outputs["--csv"]:
        write_csv(result, outputs["--csv"])
    if outputs["--markdown"]:
        write_markdown(result, outputs["--markdown"], top=top)
    if outputs["--plot"]:
        write_plot(result, outputs["--plot"])


def render(result: Any, top: int) -> None:
    if result.tensors:  # all skipped or failed: their lines below say why
        _render_tables(result, top)
    for scan in result.flagged:
        out_console.print(f"flagged {scan.name}: {'; '.join(scan.reasons)}", soft_wrap=True)
    for reason, count in sorted(Counter(s.reason for s in result.skipped).items()):
        out_console.print(f"skipped {counted(count, 'tensor')}: {reason}")
    gigabytes = result.bytes_scanned / 1e9
    out_console.print(
        f"scanned {counted(len(result.tensors), 'tensor')} ({gigabytes:.2f} GB) in {result.seconds:.1f} s "
        f"({gigabytes / max(result.seconds, 1e-9):.2f} GB/s, {counted(result.workers, 'worker')}"
        f"{', sampled' if result.sample else ', exact'}); flagged {len(result.flagged)}: "
        f"{result.rule}"
    )


def _render_tables(result: Any, top: int) -> None:
    """The worst tensors by score, and the summary per layer type."""
    score = "NRMSE" if result.share_threshold is None else "output error share, then NRMSE"
    table = Table(
        title=f"worst {counted(min(top, len(result.tensors)), 'tensor')} by {score} ({result.args.label})"
    )
    table.add_column("tensor", overflow="fold")
    for column in ("shape", "score", "ratio", "absmax", ">6 std", "flagged"):
        table.add_column(column, justify="left" if column == "shape" else "right", no_wrap=True)
    for scan in result.by_score()[:top]:
        table.add_row(
            scan.name, "x".join(map(str, scan.shape)), _number(scan.score),
            _number(scan.stats.spread_ratio), _number(scan.stats.absmax),
            f"{scan.stats.tail_share:.0e}",
            "yes" if scan.flagged else "", style="bold red" if scan.flagged else None,
        )  # fmt: skip
    out_console.print(table)
    summary = Table(title="per layer type")
    for column in ("kind", "tensors", "flagged", "mean NRMSE", "worst NRMSE", "worst ratio"):
        summary.add_column(column, justify="left" if column == "kind" else "right")
    for row in result.summary():
        summary.add_row(
            row["kind"], str(row["tensors"]), str(row["flagged"]), _number(row["nrmse_mean"]),
            _number(row["nrmse_max"]), _number(row["ratio_max"]),
        )  # fmt: skip
    out_console.print(summary)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
