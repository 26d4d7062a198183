"""Validated configuration: what to do and how. No torch here (configs say what, not how).

`quant`: quantization arguments and scheme presets; `recipe`: calibration, method knobs and the
quantize/prune Recipe; `options`: the options of quantize, prune and structured pruning, as the
CLI, recipe files and Python give them, and the Recipe they make; `distill`: how a student is
trained on a teacher.
"""

from llmq.config.distill import DistillConfig
from llmq.config.mixed import MixedConfig
from llmq.config.options import (
    CalibrationOptions,
    LayerOptions,
    PruneOptions,
    QuantizeOptions,
    StructuredOptions,
)
from llmq.config.quant import (
    FLOAT_CODE_MAX,
    FP8_BLOCK_SIZE,
    SCAN_RATIO_THRESHOLD,
    SCAN_SCHEME,
    SCAN_SHARE_THRESHOLD,
    SCHEME_ALIASES,
    SCHEMES,
    QuantArgs,
    Scheme,
    Strategy,
    fit_group_size,
    get_scheme,
    group_width,
    is_valid_group_size,
    scheme_names,
)
from llmq.config.recipe import (
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_CONFIDENCE,
    DEFAULT_REPORT_SAMPLES,
    PRUNING_METHODS,
    QUANTIZE_METHODS,
    RESUME_EVERY_S,
    SMOOTH_ALPHA,
    AWQConfig,
    CalibConfig,
    GGUFRecipe,
    GPTQConfig,
    Recipe,
    build,
    parse_smooth,
    with_group_size,
)

__all__ = [
    "DEFAULT_CALIB_SAMPLES",
    "DEFAULT_CONFIDENCE",
    "DEFAULT_REPORT_SAMPLES",
    "FLOAT_CODE_MAX",
    "FP8_BLOCK_SIZE",
    "PRUNING_METHODS",
    "QUANTIZE_METHODS",
    "RESUME_EVERY_S",
    "SCAN_RATIO_THRESHOLD",
    "SCAN_SCHEME",
    "SCAN_SHARE_THRESHOLD",
    "SCHEMES",
    "SCHEME_ALIASES",
    "SMOOTH_ALPHA",
    "AWQConfig",
    "CalibConfig",
    "CalibrationOptions",
    "DistillConfig",
    "GGUFRecipe",
    "GPTQConfig",
    "LayerOptions",
    "MixedConfig",
    "PruneOptions",
    "QuantArgs",
    "QuantizeOptions",
    "Recipe",
    "Scheme",
    "Strategy",
    "StructuredOptions",
    "build",
    "fit_group_size",
    "get_scheme",
    "group_width",
    "is_valid_group_size",
    "parse_smooth",
    "scheme_names",
    "with_group_size",
]
