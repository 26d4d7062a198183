"""`llmq distill`'s flags of pruning and quantization-aware training, as DistillConfig's
sub-configs: the flags stay flat on the command line (--prune gmp --sparsity 0.5), the config
is nested (gmp: {sparsity: 0.5}) as a recipe stage and Python give it."""

from __future__ import annotations

from typing import Any

from llmq.errors import InputError

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
