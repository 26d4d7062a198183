"""Quantized tiny checkpoints, one per scheme, written by `llmq quantize` (RTN: seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmq

FAST = {"num_samples": 2, "seq_len": 64}


@pytest.fixture(scope="session")
def tiny_quantized(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    """scheme (or scheme + options) -> a quantized copy of tiny_llama, made on first use."""
    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("quantized")

    def get(scheme: str, **options: object) -> Path:
        key = scheme + "".join(f"-{k}-{v}" for k, v in sorted(options.items()))
        if key not in made:
            made[key] = root / key
            llmq.quantize(tiny_llama, made[key], scheme=scheme, **options, **FAST)
        return made[key]

    return get
