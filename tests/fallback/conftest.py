"""What the fallback tests share: float64 references and heavy-tailed tensors for the statistics
(`test_stats`, `test_quant_error`, `test_summary`), and hand-built safetensors folders for the
scan (`test_scan`, `test_inventory`, `test_workers`, `test_output_error`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmq.config import QuantArgs
from llmq.fallback.summary import TensorStats
from llmq.quant.primitives import quantize_weight
from tests.conftest import make_tiny

# --- statistics: float64 references ----------------------------------------------------------

INT8_TENSOR = QuantArgs(num_bits=8, strategy="tensor")
INT8_TENSOR_ASYM = QuantArgs(num_bits=8, strategy="tensor", symmetric=False)
INT8_CHANNEL = QuantArgs(num_bits=8, strategy="channel")
INT4_G64_ASYM = QuantArgs(num_bits=4, strategy="group", group_size=64, symmetric=False)
FP8_TENSOR = QuantArgs(num_bits=8, type="float", strategy="tensor")


def reference(weight: torch.Tensor, args: QuantArgs | None) -> dict[str, float]:
    """float64 everything; quartiles by torch.quantile on the sorted values."""
    x = weight.to(torch.float64).reshape(-1)
    x = x[x.isfinite()]
    q1, q3 = torch.quantile(x, torch.tensor([0.25, 0.75], dtype=torch.float64)).tolist()
    mean, std = float(x.mean()), float(x.std(unbiased=False))
    out = {
        "q1": q1, "q3": q3, "mean": mean, "std": std, "min": float(x.min()), "max": float(x.max()),
        "tail_share": float(((x - mean).abs() > 6 * std).double().mean()),
    }  # fmt: skip
    if args is not None:
        rows = weight.reshape(-1, weight.shape[-1])
        scale_dtype = weight.dtype if weight.element_size() >= 2 else torch.float32
        rows = rows.to(scale_dtype)  # FP8 values are exact in float32
        restored = quantize_weight(rows, args, scale_dtype=scale_dtype).dequantize(torch.float64)
        error = (rows.to(torch.float64) - restored).square().sum()
        out["nrmse"] = math.sqrt(error / x.square().sum())
        out["range_nrmse"] = math.sqrt(error / x.numel()) / (out["max"] - out["min"])
    return out


def assert_matches(stats: TensorStats, expected: dict[str, float], *, rel: float) -> None:
    for key in ("q1", "q3", "min", "max"):  # order statistics are exact
        assert getattr(stats, key) == pytest.approx(expected[key], rel=1e-12, abs=0), key
    for key, value in expected.items():
        assert getattr(stats, key) == pytest.approx(value, rel=rel, abs=1e-12), key


def heavy_tailed(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[3, 5], w[7, 1] = 1.5, -0.9  # outliers far beyond 6 sigma
    return w.to(dtype)


# --- scan: hand-built safetensors folders ---------------------------------------------------


def gaussian(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def with_outlier(rows: int, cols: int, seed: int) -> torch.Tensor:
    w = gaussian(rows, cols, seed, torch.float32)
    w[1, 2] = 3.0  # 150 sigma: int8 per-tensor steps become 3.0/127, 1.2 sigma wide
    return w.to(torch.bfloat16)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """Two shards with an index, a nested folder, an outlier, fp8 and a packed int tensor."""
    root = tmp_path / "ckpt"
    (root / "extra").mkdir(parents=True)
    save_file(
        {
            "model.layers.0.self_attn.q_proj.weight": gaussian(128, 256, 0),
            "model.layers.0.mlp.down_proj.weight": with_outlier(256, 128, 1),
            "model.layers.0.input_layernorm.weight": torch.ones(256, dtype=torch.bfloat16),
        },
        str(root / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {
            "model.layers.1.mlp.up_proj.weight": gaussian(256, 128, 2).to(torch.float8_e4m3fn),
            "model.layers.1.mlp.up_proj.weight_packed": torch.zeros(256, 16, dtype=torch.int32),
        },
        str(root / "model-00002-of-00002.safetensors"),
    )
    save_file({"lm_head.weight": gaussian(64, 256, 3, torch.float32)}, str(root / "extra" / "head.safetensors"))  # fmt: skip
    index = {"weight_map": {"model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
                            "model.layers.1.mlp.up_proj.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


@pytest.fixture
def model_with_outlier(tmp_path: Path, default_model: Path) -> tuple[Path, str]:
    folder = make_tiny(tmp_path / "tiny", default_model)
    weights = load_file(str(folder / "model.safetensors"))
    target = "model.layers.1.self_attn.o_proj"
    weights[f"{target}.weight"][5, 7] = 40.0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, target
