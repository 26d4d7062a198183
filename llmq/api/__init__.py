"""llmq's public Python API. The CLI is a thin layer over these functions.

from llmq import quantize, calibrate, evaluate
result = quantize("smollm2-135m", "out/w4a16", scheme="w4a16")
report = evaluate("out/w4a16", baseline="smollm2-135m", max_ppl_increase=0.03)
"""

from llmq.api.calibrate import CalibrateResult, calibrate
from llmq.api.common import list_models
from llmq.api.distill import DistillResult, distill
from llmq.api.evaluate import EvalResult, evaluate, verify
from llmq.api.quantize import make_recipe, prune, quantize
from llmq.api.run import GenerateResult, bench, generate, load_dequantized, load_quantized
from llmq.api.scan import fallback_scan
from llmq.api.structured import StructuredResult, prune_structured

__all__ = [
    "CalibrateResult",
    "DistillResult",
    "EvalResult",
    "GenerateResult",
    "StructuredResult",
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
