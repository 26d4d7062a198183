"""TF32 for the layer loop's matrix products: switched on for the job, restored after it."""

from __future__ import annotations

import pytest
import torch

from llmq.calib.precision import tensor_float32


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_is_set_inside_and_restored_after_even_on_error(enabled: bool) -> None:
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (matmul.allow_tf32, cudnn.allow_tf32)
    with pytest.raises(RuntimeError), tensor_float32(enabled):
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (enabled, enabled)
        raise RuntimeError("a failed layer")
    assert (matmul.allow_tf32, cudnn.allow_tf32) == before
