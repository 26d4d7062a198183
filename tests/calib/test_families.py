"""The layer stream computes what transformers computes, family by family: Gemma's scaled
embeddings, per-type rotary tables and (1 + weight) norms, sliding-window layers shorter than
the sequence, Gemma 2's capped attention and output logits. The reference is transformers'
own model with eager attention, in float32, on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmq.eval.logits import evaluator_log_probs
from llmq.io.checkpoint import open_checkpoint
from tests.conftest import make_tiny

WINDOW = 8  # shorter than the 24-token prompts, so the sliding layers see fewer keys
LAYER_TYPES = ["sliding_attention", "full_attention"]
FAMILIES = {
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": LAYER_TYPES},
    "gemma2": {
        "sliding_window": WINDOW,
        "layer_types": LAYER_TYPES,
        "attn_logit_softcapping": 5.0,  # low caps, so capping changes the result
        "final_logit_softcapping": 3.0,
    },
    "mistral": {"sliding_window": WINDOW},
    "phi3": {"sliding_window": WINDOW},
    "qwen2": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 0},
}


def reference_log_probs(model: Path, ids: torch.Tensor, **config: object) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager", **config
    )
    with torch.no_grad():
        return torch.log_softmax(hf(ids).logits.float(), dim=-1)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_stream_log_probs_equal_transformers(
    tmp_path: Path, default_model: Path, model_type: str
) -> None:
    model = make_tiny(
        tmp_path / model_type, default_model, model_type=model_type, **FAMILIES[model_type]
    )
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = reference_log_probs(model, ids)
    got = torch.stack(evaluator_log_probs(open_checkpoint(model), ids.tolist()))
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4)
    # the window matters: without it, the same weights give other numbers
    unwindowed = reference_log_probs(model, ids, sliding_window=512)
    assert (unwindowed - expected).abs().max() > 1e-2
