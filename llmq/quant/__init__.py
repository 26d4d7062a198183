"""Quantization primitives and methods: pure tensor functions, no modules, no files."""
