"""Options several commands share, declared once; the defaults of a command's options come from
its options model in llmq.config (`defaults`), and its parameters go back into one (`given`).

One vocabulary across commands (docs/cli.md): a renamed flag keeps its old spelling through
`renamed` (hidden, with a warning), a share takes `fraction` (0.5 or 50%), a list of names takes
`names` (repeated, or comma-separated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from llmq.config.fraction import EXPECTED, parse_fraction
from llmq.errors import InputError

# Old spelling -> the flag it is now, for every command: llmq.cli.help hides the old ones from
# --help and warns when one is used.
RENAMED: dict[str, str] = {}


def renamed(new: str, *old: str) -> tuple[str, ...]:
    """The names of a renamed option, for `typer.Option(*renamed("--eval-text", "--text"))`:
    the new one, then old spellings that still work, hidden from --help, each with a one-line
    `warning: --text is now --eval-text`."""
    for name in old:
        if RENAMED.setdefault(name, new) != new:
            raise ValueError(f"{name} is already an old spelling of {RENAMED[name]}")
    return (new, *old)


def old_spellings(param: Any) -> list[str]:
    """The names of `param` (a click option) that are old spellings of another of its names."""
    return [name for name in param.opts if RENAMED.get(name) in param.opts]


def fraction(option: str) -> Callable[[Any], float]:
    """The parser of an option that takes a share, 0.03 or 3% (`typer.Option(parser=...)`, or
    called on a value). A bad value is an InputError naming the option: one `error:` line and
    exit 2, also while the command line is parsed (llmq.cli.help)."""

    def parse(value: Any) -> float:
        try:
            return parse_fraction(value)
        except ValueError:
            raise InputError(f"{option} {value!r}: expected {EXPECTED}") from None

    return parse


def names(values: Iterable[str] | None) -> list[str]:
    """A list option's values, given repeated or comma-separated (or both): `--loader vllm
    --loader llmq` is `--loader vllm,llmq`."""
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


# Option sections in --help (llmq.cli.help), the same words in every command.
OUTPUT = "Output"
SCHEME = "Scheme"
CALIBRATION = "Calibration"
METHOD = "Method"
PRUNING = "Pruning"
RUN = "Run"

ModelArg = Annotated[
    str, typer.Argument(help="Checkpoint folder, or a built-in name (see llmq models).")
]
CalibText = Annotated[
    str,
    typer.Option(
        metavar="TEXT",
        help="Calibration text: shakespeare, pydoc, news (join with +), a file or a cached dataset.",
        rich_help_panel=CALIBRATION,
    ),
]
Seed = Annotated[
    int,
    typer.Option(
        metavar="N", help="Seed for sampling calibration windows.", rich_help_panel=CALIBRATION
    ),
]
MoeCalibration = Annotated[
    str,
    typer.Option(
        metavar="MODE",
        help="Mixtures of experts: all (every token through every expert for the statistics; "
        "the output keeps the model's routing) or routed (each expert on its routed tokens).",
        rich_help_panel=CALIBRATION,
    ),
]
JsonFlag = Annotated[
    bool,
    typer.Option("--json", help="Print the result as JSON on stdout.", rich_help_panel=OUTPUT),
]
Device = Annotated[
    str,
    typer.Option(
        help="Where to run: auto (a GPU if there is one), cpu, cuda or cuda:N.",
        rich_help_panel=RUN,
    ),
]
StageActivations = Annotated[
    str,
    typer.Option(
        metavar="SETTING",
        help="GPTQ's stages in a layer: keep their activations (fast), recompute them (less "
        "memory) or auto (keep where they fit in 80% of free GPU memory).",
        rich_help_panel=RUN,
    ),
]
Tf32 = Annotated[
    bool,
    typer.Option(
        "--tf32/--no-tf32",
        help="On a GPU, float32 products in TF32 (about 2x faster); --no-tf32: true float32.",
        rich_help_panel=RUN,
    ),
]
Dtype = Annotated[
    str,
    typer.Option(
        help="Compute dtype: auto (bfloat16 on a GPU, float32 on the CPU), bfloat16, float16 or "
        "float32.",
        rich_help_panel=RUN,
    ),
]
Kernels = Annotated[
    str,
    typer.Option(
        help="Quantized linears run on: auto (Triton on a GPU, torch on the CPU), triton or torch.",
        rich_help_panel=RUN,
    ),
]
SpaceCheck = Annotated[
    bool,
    typer.Option(
        "--space-check/--no-space-check",
        help="Refuse, before any work, an output that will not fit in the free disk space.",
        rich_help_panel=OUTPUT,
    ),
]

_IGNORE_HELP = "Linears to leave as they are: a name, a suffix or re:REGEX; repeatable."
Ignore = Annotated[
    list[str] | None, typer.Option(metavar="NAME", help=_IGNORE_HELP, rich_help_panel=SCHEME)
]
PruneIgnore = Annotated[  # the same option, in prune's section
    list[str] | None, typer.Option(metavar="NAME", help=_IGNORE_HELP, rich_help_panel=PRUNING)
]

DampeningFrac = Annotated[
    float,
    typer.Option(
        metavar="X",
        parser=fraction("--dampening-frac"),
        help="gptq, sparsegpt: Hessian dampening, a fraction of its mean diagonal, in (0, 1).",
        rich_help_panel=METHOD,
    ),
]

TrueSequential = Annotated[
    bool,
    typer.Option(
        help="gptq, sparsegpt, wanda: compress q/k/v, o_proj, gate/up, down_proj in turn "
        "(one pass, more memory).",
        rich_help_panel=METHOD,
    ),
]

SparsityOption = Annotated[
    float | None,
    typer.Option(
        metavar="X",
        parser=fraction("--sparsity"),
        help="Share of each row's weights to prune (0.5 or 50%); --sparsity or --pattern (not "
        "both).",
        rich_help_panel=PRUNING,
    ),
]

PatternOption = Annotated[
    str | None,
    typer.Option(
        metavar="N:M",
        help="Keep at most N of every M inputs (2:4, 4:8); --sparsity or --pattern (not both).",
        rich_help_panel=PRUNING,
    ),
]

CalibStatsPath = Annotated[
    Path | None,
    typer.Option(
        metavar="FILE",
        help="Reuse statistics saved by llmq calibrate instead of collecting them.",
        rich_help_panel=CALIBRATION,
    ),
]

Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an OUT that llmq wrote (or an empty one), once the new one is complete.",
        rich_help_panel=OUTPUT,
    ),
]

Resume = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue an interrupted run into the same OUT with the same options.",
        rich_help_panel=OUTPUT,
    ),
]

ResumeEvery = Annotated[
    float,
    typer.Option(
        metavar="SECONDS",
        help="Seconds between resume points (hidden states saved for --resume); 0: every layer.",
        rich_help_panel=OUTPUT,
    ),
]

Reference = Annotated[
    bool,
    typer.Option(
        help="Record in llmq.json what the written files compute on three prompts, for llmq verify.",
        rich_help_panel=OUTPUT,
    ),
]

SeqLen = Annotated[
    int,
    typer.Option(metavar="N", help="Tokens per calibration window.", rich_help_panel=CALIBRATION),
]

SparsityProfile = Annotated[
    str,
    typer.Option(
        metavar="PROFILE",
        help="--sparsity over the layers: uniform, owl (by outliers) or scan (by output error).",
        rich_help_panel=PRUNING,
    ),
]


def defaults(kind: Any) -> dict[str, Any]:
    """The default of each option of `kind` (a llmq.config options model): a command's
    parameters default to these, so that a default is stated once."""
    return {name: info.default for name, info in kind.model_fields.items()}


def given(kind: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The command's parameters that are options of `kind`, by name."""
    return {name: value for name, value in params.items() if name in kind.model_fields}


def explicit(ctx: Any) -> set[str]:
    """The parameters given on the command line (not left at their defaults)."""
    return {name for name in ctx.params if ctx.get_parameter_source(name).name != "DEFAULT"}


def from_flags(kind: Any, values: dict[str, Any]) -> Any:
    """`kind.of(**values)` for a command: an error naming an option names it as its flag, with
    the value given (`--num-samples 0: ...`), as the user typed it."""
    try:
        return kind.of(**values)
    except InputError as error:
        name, _, rest = error.message.partition(": ")
        if name not in values or not rest:
            raise
        flag = f"--{name.replace('_', '-')} {values[name]}"
        raise InputError(f"{flag}: {rest}", hint=error.hint) from None
