"""Compile every kernel variant llmq launches, for a real GPU target, on a machine without one:
Triton's ahead-of-time path runs the whole compiler (type checks, layouts, LLVM, PTX) without a
driver, so CUDA-only failures (non-constexpr globals, dot operand types, layouts) show up in CI.

Run as a script in a process without TRITON_INTERPRET (the interpreter replaces the kernels);
prints one line per variant and exits 1 if any fails. Usage: compile_for_gpu.py [ARCH ...]
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget

from llmq.kernels import w4a16, w8a8
from llmq.kernels.support import TileConfig

CPU = torch.device("cpu")


def with_split(config: TileConfig) -> TileConfig:
    """Decode configs as a GPU gets them: split K (the atomic-add epilogue)."""
    return dataclasses.replace(config, split_k=4) if config.path == "decode" else config


def w4a16_variants():
    base = {"x_ptr": None, "packed_ptr": "*i32", "scale_ptr": None, "zero_ptr": "*i8",
            "g_idx_ptr": "*i32", "out_ptr": None, "M": "i32", "N": "i32", "K": "i32",
            **dict.fromkeys(("stride_xm", "stride_xk", "stride_pn", "stride_pw", "stride_sn", "stride_sg", "stride_om", "stride_on"), "i32")}  # fmt: skip
    # int4, int4 with zero points and g_idx, FP4 (E2M1) codes in groups of 16; M 0: the GEMV
    kinds = ((False, False, False), (True, True, False), (False, False, True))
    for dtype, m, (zero, g_idx, fp4) in itertools.product(("fp16", "bf16"), (0, 1, 64), kinds):
        group = 16 if fp4 else 128
        config = with_split(w4a16.choose_config(max(m, 1), 4096, 4096, group, CPU))
        config = dataclasses.replace(config, block_m=1) if m == 0 else config
        config_split = config.split_k
        out = "*fp32" if config_split > 1 else f"*{dtype}"
        signature = {**base, "x_ptr": f"*{dtype}", "scale_ptr": f"*{dtype}",
                     "out_ptr": out, "SPLIT_K": "i32"}  # fmt: skip
        constexprs = {
            "GROUP_SIZE": group, "HAS_ZERO": zero, "HAS_G_IDX": g_idx, "FP4": fp4,
            "DOT_DTYPE": getattr(triton.language, {"fp16": "float16", "bf16": "bfloat16"}[dtype]),
            "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
            "BLOCK_K": config.block_k, "ATOMIC": config_split > 1,
        }  # fmt: skip
        name = (f"w4a16 {dtype} {config.path} rows{config.block_m} split{config_split} "
                f"zero={zero} g_idx={g_idx} fp4={fp4}")  # fmt: skip
        yield name, w4a16._w4a16_kernel, signature, constexprs, config
    signature = {"packed_ptr": "*i32", "scale_ptr": "*bf16", "zero_ptr": "*i8",
                 "g_idx_ptr": "*i32", "out_ptr": "*bf16", "N": "i32", "K": "i32",
                 **dict.fromkeys(("stride_pn", "stride_pw", "stride_sn", "stride_sg", "stride_on", "stride_ok"), "i32")}  # fmt: skip
    constexprs = {"GROUP_SIZE": 128, "HAS_ZERO": True, "HAS_G_IDX": False, "FP4": False,
                  "BLOCK_N": 64, "BLOCK_K": 64}  # fmt: skip
    yield "w4a16 dequantize", w4a16._dequantize_kernel, signature, constexprs, None


def w8a8_variants():
    for fp8 in (False, True):
        codes = "*fp8e4nv" if fp8 else "*i8"
        signature = {"x_ptr": "*bf16", "codes_ptr": codes, "scale_ptr": "*fp32",
                     "static_ptr": "*fp32", "K": "i32",
                     "stride_xm": "i32", "stride_cm": "i32"}  # fmt: skip
        for static in (False, True):
            yield (f"quantize rows fp8={fp8} static={static}", w8a8._quantize_rows_kernel,
                   signature, {"FP8": fp8, "STATIC": static, "BLOCK": 1024}, None)  # fmt: skip
        for m in (1, 64, 1024):
            config = with_split(w8a8.choose_config(m, 4096, 4096, fp8, CPU))
            out = "*fp32" if config.split_k > 1 else "*bf16"
            signature = {"a_ptr": codes, "b_ptr": codes, "a_scale_ptr": "*fp32",
                         "b_scale_ptr": "*fp32", "out_ptr": out, "M": "i32", "N": "i32",
                         "K": "i32", **dict.fromkeys(("stride_am", "stride_ak", "stride_bn", "stride_bk", "stride_om", "stride_on"), "i32"),
                         "SPLIT_K": "i32"}  # fmt: skip
            constexprs = {"FP8": fp8, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                          "BLOCK_K": config.block_k, "ATOMIC": config.split_k > 1}  # fmt: skip
            yield (f"w8a8 fp8={fp8} {config.path} M={m} split{config.split_k}",
                   w8a8._w8a8_kernel, signature, constexprs, config)  # fmt: skip


def main(archs: list[int]) -> int:
    failed = 0
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for name, kernel, signature, constexprs, config in (*w4a16_variants(), *w8a8_variants()):
            if arch < 89 and ("fp8=True" in name):
                continue  # FP8 needs sm_89+
            options = {} if config is None else {
                "num_warps": config.num_warps, "num_stages": config.num_stages}  # fmt: skip
            src = triton.compiler.ASTSource(
                fn=kernel,
                signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                constexprs=constexprs,
            )
            try:
                compiled = triton.compile(src, target=target, options=options)
                ok = "ptx" in compiled.asm
                print(f"sm_{arch} {name}: {'ok' if ok else 'no ptx'}")
                failed += not ok
            except Exception as exc:  # report every variant, then fail
                first = str(exc).strip().splitlines()
                print(f"sm_{arch} {name}: FAILED {type(exc).__name__}: {' | '.join(first[-3:])}")
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
