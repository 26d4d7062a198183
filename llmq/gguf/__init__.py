"""GGUF block encoders: choose a type's grid (scales and mins as the decoder sees them), round
weights to codes on it, and pack them into the bytes llama.cpp reads.

    grid = choose_grid("Q4_K", weight, importance)   # [rows, cols] float32, [cols] or None
    codes = codes_for(grid, weight)                   # int8 [rows, cols]
    data = pack(grid, codes)                          # uint8 [rows, bytes per row]

The two steps are apart so that a GPTQ-style loop can fix the grid first and then choose codes
column by column against grid.step / grid.offset.
"""

from __future__ import annotations

from llmq.gguf.blocks import SPECS, BlockSpec, Grid, block_spec, codes_for, dequantized, pack
from llmq.gguf.grids import choose_grid, quantize

__all__ = [
    "SPECS",
    "BlockSpec",
    "Grid",
    "block_spec",
    "choose_grid",
    "codes_for",
    "dequantized",
    "pack",
    "quantize",
]
