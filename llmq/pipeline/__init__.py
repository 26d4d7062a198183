"""The layer-by-layer pipeline that carries every calibrated method (plan, run, resume)."""
