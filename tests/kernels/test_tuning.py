"""Measured launch tables: lookup by M bucket, K splits from waves, the table file round trip,
and kernels launched from a table still computing the exact product."""

from __future__ import annotations

import pytest
import torch

from llmq.errors import InputError
from llmq.kernels import reference, tuning, w4a16, w8a8
from llmq.kernels.support import TileConfig, split_for
from llmq.kernels.tuning import TunedConfig, load_table, m_bucket, table_json, table_name
from tests.kernels.conftest import assert_within_bound
from tests.kernels.test_w4a16 import exact_product, random_weight
from tests.kernels.test_w8a8 import activations, weight_codes

CPU = torch.device("cpu")  # the interpreter counts 4 SMs
GEMV = TunedConfig("decode", 1, 32, 64, waves=2, num_warps=4, num_stages=3)
DECODE = TunedConfig("decode", 16, 32, 128, waves=4, num_warps=4, num_stages=4)
TILED = TunedConfig("tiled", 32, 64, 64, waves=0, num_warps=4, num_stages=3)


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    configs = {
        "w4a16": {1: GEMV, 16: DECODE, 64: TILED},
        "w8a8_int8": {16: DECODE},
    }
    path.write_text(table_json(configs, gpu="test"))
    monkeypatch.setenv(tuning.TUNING_ENV, str(path))
    return path


def test_m_buckets_and_names() -> None:
    assert [m_bucket(m) for m in (1, 2, 16, 17, 64, 65, 4096, 9000)] == [
        1, 16, 16, 64, 64, 256, 4096, 4096,
    ]  # fmt: skip
    assert table_name("NVIDIA H200") == "nvidia-h200"
    assert table_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_split_fills_the_sms_and_never_exceeds_k_tiles() -> None:
    # 1 x 256 output tiles of 32 columns: 8 tiles, 4 waves on 4 SMs -> 16 programs -> split 2
    assert split_for(4, 1, 256, 4096, 16, 32, 128, CPU) == 2
    assert split_for(0, 1, 256, 4096, 16, 32, 128, CPU) == 1
    assert split_for(64, 1, 32, 256, 16, 32, 128, CPU) == 2  # only 2 K tiles
    assert split_for(4, 1, 4096, 4096, 16, 32, 128, CPU) == 1  # already 128 output tiles


def test_table_round_trip_and_lookup(table) -> None:
    assert load_table(table)["w4a16"] == {1: GEMV, 16: DECODE, 64: TILED}
    # M = 2 -> bucket 16; M = 40 -> bucket 64; M = 300 -> bucket 1024 (absent): the built-in rule
    assert w4a16.choose_config(2, 256, 4096, 128, CPU) == TileConfig(
        "decode", 16, 32, 128, split_k=2, num_warps=4, num_stages=4
    )
    assert w4a16.choose_config(40, 256, 4096, 128, CPU) == TileConfig("tiled", 32, 64, 64)
    assert w4a16.choose_config(300, 256, 4096, 128, CPU).path == "dequant"
    # a K tile never straddles groups: the table's block_k is capped at the group size
    assert w4a16.choose_config(16, 256, 4096, 32, CPU).block_k == 32
    # kernels are tuned separately: int8's table entry does not apply to FP8
    assert w8a8.choose_config(16, 256, 4096, False, CPU).block_n == 32
    assert w8a8.choose_config(16, 256, 4096, True, CPU).block_n == 64


@pytest.mark.interpreter
def test_tuned_w4a16_launches_compute_the_exact_product(table) -> None:
    for act_order in (False, True):
        weight = random_weight(96, 512, 128, asym=True, act_order=act_order)
        for m in (1, 3, 40):  # one-row split-K, 16-row split-K and tiled, all from the table
            x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).half()
            exact, magnitude = exact_product(x, weight)
            assert_within_bound(w4a16.w4a16_matmul(x, weight), exact, magnitude, torch.float16)
    assert w4a16.choose_config(1, 96, 512, 128, CPU).split_k > 1


@pytest.mark.interpreter
def test_tuned_w8a8_launch_matches_the_reference(table) -> None:
    weight = weight_codes(96, 512, fp8=False)
    x = activations(16, 512, torch.float16, seed=1)
    assert w8a8.choose_config(16, 96, 512, False, CPU).block_n == 32  # from the table
    expected = reference.w8a8_linear(x, weight).float()
    assert torch.allclose(w8a8.w8a8_matmul(x, weight).float(), expected, rtol=2e-3, atol=1e-3)


def test_a_broken_table_is_one_clear_error(tmp_path, monkeypatch) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"kernels": {"w4a16": {"1": {"path": "decode"}}}}')
    monkeypatch.setenv(tuning.TUNING_ENV, str(path))
    with pytest.raises(InputError, match="not a kernel tuning table"):
        w4a16.choose_config(1, 256, 4096, 128, CPU)


@pytest.mark.parametrize("path", sorted(tuning.TUNED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_tables_cover_every_kernel_and_bucket(path) -> None:
    table = load_table(path)
    assert set(table) == set(tuning.KERNELS)
    for by_m in table.values():
        assert set(by_m) == set(tuning.M_BUCKETS)
        for m, config in by_m.items():
            assert config.path == ("decode" if m <= 16 else config.path)
            assert config.path in ("decode", "tiled", "dequant")
