"""Quantized GEMM kernels for llmq's packed formats: Triton kernels with their launchers
(`w4a16`, `w8a8`), the torch reference of the same math (`reference`), and both as torch custom
ops (`ops`). Importing this package imports no Triton."""
