"""llmq: make LLM checkpoints smaller and faster without losing their accuracy.

Importing llmq is cheap: the API functions load torch only when called.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "bench",
    "calibrate",
    "distill",
    "evaluate",
    "fallback_scan",
    "generate",
    "list_models",
    "load_dequantized",
    "load_quantized",
    "make_recipe",
    "prune",
    "prune_structured",
    "quantize",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from llmq import api

        return getattr(api, name)
    raise AttributeError(f"module 'llmq' has no attribute {name!r}")
