"""Calibration: text loading, the layer-by-layer stream and per-linear input statistics."""
