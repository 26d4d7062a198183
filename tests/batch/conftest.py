"""Two tiny models and a jobs file over them, shared by the batch tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_tiny

CALIB = "num_samples: 4, seq_len: 64"
RECIPES = f"""\
  - {{name: w8a16, stages: [{{quantize: {{scheme: w8a16, {CALIB}}}}}]}}
  - {{name: w4a16-gptq, stages: [{{quantize: {{scheme: w4a16, group_size: 64, method: gptq, {CALIB}}}}}]}}
"""


@pytest.fixture(scope="session")
def batch_models(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """A folder holding tiny-a and tiny-b (different shapes, the default model's tokenizer)."""
    root = tmp_path_factory.mktemp("batch-models")
    make_tiny(root / "tiny-a", default_model)
    make_tiny(root / "tiny-b", default_model, hidden=128, heads=2)
    return root


def write_jobs(folder: Path, models: Path, recipes: str = RECIPES, extra: str = "") -> Path:
    """folder/jobs.yaml: the two tiny models in `models` x the recipes given."""
    path = folder / "jobs.yaml"
    path.write_text(f"models: [{models}/tiny-a, {models}/tiny-b]\nrecipes:\n{recipes}{extra}")
    return path


def output_bytes(out: Path) -> dict[str, bytes]:
    """Every job's weights, by path under OUT (what must be identical across runs)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("*/*/**/*.safetensors"))}  # fmt: skip
