"""`llmq distill`'s flags of pruning and quantization-aware training: their declarations (the
command's signature uses them, with DistillConfig's defaults), and their values as
DistillConfig's sub-configs: the flags stay flat on the command line (--prune gmp --sparsity
0.5), the config is nested (gmp: {sparsity: 0.5}) as a recipe stage and Python give it."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from llmq.cli.options import PRUNING, fraction
from llmq.errors import InputError

QAT = "Quantization"  # the help panel of --qat and its flags

_SUB_CONFIG_FLAGS = {
    # DistillConfig's sub-config: its fields by the flags that set them
    "gmp": {"prune_method": "method", "sparsity": "sparsity", "pattern": "pattern",
            "prune_start": "start", "prune_end": "end", "prune_every": "every"},
    "iterative": {"prune_method": "method", "sparsity": "sparsity", "rounds": "rounds",
                  "round_schedule": "schedule"},
    "qat": {"qat": "scheme", "qat_group_size": "group_size", "qat_init": "init"},
}  # fmt: skip


def sub_configs(params: dict[str, Any], given: set[str]) -> dict[str, dict[str, Any]]:
    """--prune gmp|iterative and --qat with the flags that go with them, as DistillConfig's
    `gmp`, `iterative` and `qat` sub-configs (the flags given, the rest their defaults); a flag
    of a sub-config not chosen is refused."""
    if params["prune"] not in ("none", "gmp", "iterative"):
        raise InputError(f"--prune {params['prune']!r}: not a way to prune", hint="choose one of: none, gmp, iterative")  # fmt: skip
    chosen = {params["prune"], "qat" if params["qat"] is not None else "none"} - {"none"}
    configs = {
        name: {field: params[flag] for flag, field in flags.items() if flag in given}
        for name, flags in _SUB_CONFIG_FLAGS.items()
        if name in chosen
    }
    for flag in sorted(given - {flag for name in chosen for flag in _SUB_CONFIG_FLAGS[name]}):
        owners = [name for name, flags in _SUB_CONFIG_FLAGS.items() if flag in flags]
        if owners:
            wanted = " or ".join(f"--prune {o}" if o != "qat" else "--qat" for o in owners)
            raise InputError(f"--{flag.replace('_', '-')}: goes with {wanted}")
    return configs


# The flags, as `llmq distill` declares them (their defaults are DistillConfig's, given there).
PruneFlag = Annotated[
    str,
    typer.Option(
        metavar="NAME",
        help="none, gmp (gradually while training) or iterative (prune, distill, repeat).",
        rich_help_panel=PRUNING,
    ),
]
PruneMethodFlag = Annotated[
    str,
    typer.Option(
        metavar="NAME",
        help="Scores weights: magnitude, wanda, or (iterative only) sparsegpt or structured.",
        rich_help_panel=PRUNING,
    ),
]
SparsityFlag = Annotated[
    float | None,
    typer.Option(
        metavar="X",
        parser=fraction("--sparsity"),
        help="The final share of each row's weights removed (0.5 or 50%); --sparsity or "
        "--pattern (not both).",
        rich_help_panel=PRUNING,
    ),
]
PatternFlag = Annotated[
    str | None,
    typer.Option(
        metavar="N:M",
        help="--prune gmp: an N:M pattern to reach (2:4); --sparsity or --pattern (not both).",
        rich_help_panel=PRUNING,
    ),
]
PruneStartFlag = Annotated[
    int,
    typer.Option(
        metavar="N",
        help="--prune gmp: the step pruning starts at.",
        rich_help_panel=PRUNING,
    ),
]
PruneEndFlag = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help="--prune gmp: the step the final sparsity is reached at (default: 3/4 of them).",
        rich_help_panel=PRUNING,
    ),
]
PruneEveryFlag = Annotated[
    int,
    typer.Option(
        metavar="N",
        help="--prune gmp: steps between mask updates.",
        rich_help_panel=PRUNING,
    ),
]
RoundsFlag = Annotated[
    int,
    typer.Option(
        metavar="N",
        help="--prune iterative: prune-then-distill rounds.",
        rich_help_panel=PRUNING,
    ),
]
RoundScheduleFlag = Annotated[
    str,
    typer.Option(
        metavar="NAME",
        help="--prune iterative: the sparsity after each round, cubic or geometric.",
        rich_help_panel=PRUNING,
    ),
]
StepsPerRoundFlag = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help="--prune iterative: training steps after each pruning (default: --max-steps split).",
        rich_help_panel=PRUNING,
    ),
]
QatFlag = Annotated[
    str | None,
    typer.Option(
        metavar="SCHEME",
        help="Train fake-quantized and write this scheme: w4a16, w4a16-asym, w8a16, w8a8 or fp8.",
        rich_help_panel=QAT,
    ),
]
QatGroupSizeFlag = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        help="--qat: the group size, or -1 per output channel (default: the scheme's).",
        rich_help_panel=QAT,
    ),
]
QatInitFlag = Annotated[
    str,
    typer.Option(
        metavar="NAME",
        help="--qat: start from the float weights (float) or a gptq or awq solution.",
        rich_help_panel=QAT,
    ),
]
