"""GPTQ on GGUF grids: with correlated inputs its codes cut the output error that nearest
rounding on the same grid leaves; with uncorrelated inputs (an identity Hessian) it has nothing
to feed forward and gives the nearest codes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmq.gguf.blocks import codes_for, dequantized, pack
from llmq.gguf.gptq import gptq_codes
from llmq.gguf.grids import choose_grid


def _layer(cols: int = 512, rows: int = 48, tokens: int = 4096):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    mixing = torch.randn(cols, cols, generator=generator) / cols**0.5 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=generator) @ mixing  # correlated channels
    return weight.numpy(), x, 2 * x.T @ x / tokens


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
def test_error_feedback_cuts_the_output_error_of_nearest_rounding(qtype: str) -> None:
    weight, x, hessian = _layer()
    grid = choose_grid(qtype, weight, hessian.diagonal().numpy() / 2)
    nearest, fed = codes_for(grid, weight), gptq_codes(grid, weight, hessian)
    errors = {}
    for name, codes in (("nearest", nearest), ("gptq", fed)):
        decoded = dequantized(grid, codes)
        assert np.array_equal(gguf.quants.dequantize(pack(grid, codes), grid.qtype), decoded)
        errors[name] = float(((torch.from_numpy(decoded - weight) @ x.T) ** 2).mean())
    assert errors["gptq"] < 0.8 * errors["nearest"], errors


def test_an_identity_hessian_gives_the_nearest_codes() -> None:
    weight, _, _ = _layer()
    grid = choose_grid("Q4_K", weight)
    assert np.array_equal(gptq_codes(grid, weight, torch.eye(512)), codes_for(grid, weight))


def test_streamed_statistics_hold_one_layer_at_a_time(tmp_path, default_model) -> None:
    """GPTQ's statistics for GGUF come layer by layer as the writer reaches each layer: a
    layer's Hessians are released when the next is asked for, and asking back is an error (the
    plan is in layer order). The values are the whole pass's (collect_stats), layer for layer."""
    import pytest
    import torch

    from llmq.calib.collect import collect_stats
    from llmq.calib.windows import model_windows
    from llmq.config import CalibConfig
    from llmq.gguf.statistics import StreamedStatistics
    from llmq.io.checkpoint import open_checkpoint
    from tests.conftest import make_tiny

    source = make_tiny(tmp_path / "m", default_model, hidden=256, heads=4, kv_heads=2, layers=3)
    ckpt = open_checkpoint(source)
    calibration = CalibConfig(num_samples=2, seq_len=32)
    whole = collect_stats(ckpt, model_windows(source, calibration).input_ids, hessian=True, norms=True)  # fmt: skip
    streamed = StreamedStatistics(ckpt, calibration)
    for layer in range(3):
        name = f"model.layers.{layer}.mlp.down_proj"
        torch.testing.assert_close(streamed.hessian(f"{name}.weight"), whole.inputs[name].hessian)
        assert streamed.importance(f"blk.{layer}.ffn_down.weight") is not None
    with pytest.raises(RuntimeError, match="layer 1 asked for after layer 2"):
        streamed.hessian("model.layers.1.self_attn.q_proj.weight")
    streamed.close()
