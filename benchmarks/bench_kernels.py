"""llmq's Triton GEMMs against torch and torch's own quantized paths, on Llama-3 8B/70B layer
shapes, in one run on one GPU. Prints time per call and speedup over bf16 torch.matmul per
shape and M, and writes benchmarks/out/kernels/results.json.

    python benchmarks/bench_kernels.py [--shapes 4096x4096,...] [--m 1,16,...] [--quick]

Method (the one ../shared/gpu-baselines.md describes, so the numbers compare):
- data: W ~ N(0, 0.02^2), x ~ N(0, 1) in bf16; llmq weights quantized by llmq's own primitives
  and packed as `llmq quantize` writes them (W4A16 group 128 symmetric; W8A8 int8 and FP8
  per channel, activations per token at run time, their quantization inside the timed call);
- tinygemm only up to M = 64 (it is 0.04-0.07x bf16 beyond, per the baselines);
- the GEMM part alone (the `*_fp8_gemm` rows): llmq's FP8 GEMM and `torch._scaled_mm` on the same
  activations quantized beforehand, so neither call includes the activation quantization;
- timing: `llmq.runtime.timing.median_seconds`: each variant captured in a CUDA graph over
  rotating copies of its weights (>= 256 MiB in all, so reads come from HBM, not L2), replayed
  for >= 2 ms per trial, median of 15 trials;
- correctness first: every path's output against a float32 product of the same (de)quantized
  operands, ||out - ref|| / ||ref|| <= 0.01; a path over the limit is reported WRONG, not timed.
Without a GPU it says so and exits 2: kernel speed is only measured on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from llmq.config import get_scheme  # noqa: E402
from llmq.kernels.reference import quantize_rows  # noqa: E402
from llmq.runtime.bench import Shape, synthetic_linear  # noqa: E402
from llmq.runtime.timing import copies_for, median_seconds  # noqa: E402

LAYERS = {  # N x K (nn.Linear [out, in])
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (28672, 4096),
    "8B down": (4096, 14336),
    "70B qkv": (10240, 8192),
    "70B o": (8192, 8192),
    "70B gate_up": (57344, 8192),
    "70B down": (8192, 28672),
}
BATCHES = (1, 16, 64, 256, 1024, 4096)
TOLERANCE = 0.01
TINYGEMM_MAX_M = 64  # beyond, tinygemm is 0.04-0.07x bf16 (../shared/gpu-baselines.md): not timed
INT_MM_MIN_M = 17  # torch._int_mm refuses M <= 16: such products are padded to 32 rows

Variant = Callable[[Any], torch.Tensor]  # x -> y, bound to one copy of the weights
GEMM_ONLY = ("llmq_fp8_gemm", "torch_fp8_gemm")
"""Variants whose call takes the activations already quantized per token: (codes, scales)."""


def _llmq(
    scheme: str, n: int, k: int, copies: int, device: torch.device, *, gemm_only: bool = False
) -> tuple[list[Variant], torch.Tensor]:
    """llmq's kernel (Triton on a GPU; the torch reference in a CPU smoke test), or
    (`gemm_only`, W8A8 schemes) its GEMM alone, `w8a8_gemm`, on activations quantized beforehand
    (Triton always: under TRITON_INTERPRET=1 on a CPU)."""
    module = synthetic_linear(
        Shape(1, n, k), get_scheme(scheme), device, torch.bfloat16,
        triton=gemm_only or device.type == "cuda",
    )  # fmt: skip
    modules = [module] + [copy.deepcopy(module) for _ in range(copies - 1)]
    if not gemm_only:
        return [m.matmul for m in modules], module.dequantized_weight(torch.float32)
    from llmq.kernels.w8a8 import w8a8_gemm

    calls = [lambda q, w=m.layout: w8a8_gemm(*q, w) for m in modules]
    return calls, module.dequantized_weight(torch.float32)


def _dense(weight: torch.Tensor, dtype: torch.dtype, copies: int) -> list[Variant]:
    ws = [weight.to(dtype).clone() for _ in range(copies)]
    return [lambda x, w=w: x.to(dtype) @ w.T for w in ws]


def _int8_torch(weight: torch.Tensor, copies: int) -> tuple[list[Variant], torch.Tensor]:
    """Plain torch: per-token quantization, _int_mm (M padded past 16), float epilogue."""
    scale = weight.abs().amax(dim=1) / 127
    codes = (weight / scale[:, None]).round().to(torch.int8)

    def run(x: torch.Tensor, codes_t: torch.Tensor) -> torch.Tensor:
        q, sx = quantize_rows(x, fp8=False)
        m = q.shape[0]
        if m < INT_MM_MIN_M:
            q = torch.nn.functional.pad(q, (0, 0, 0, 32 - m))
        acc = torch._int_mm(q, codes_t)[:m]
        return (acc.float() * sx[:, None] * scale[None, :]).to(torch.bfloat16)

    copies_t = [codes.T.contiguous().T.clone() for _ in range(copies)]  # column-major [K, N]
    return [functools.partial(run, codes_t=c.T) for c in copies_t], codes.float() * scale[:, None]


def _fp8_torch(
    weight: torch.Tensor, copies: int, fast: bool, *, gemm_only: bool = False
) -> tuple[list[Variant], torch.Tensor]:
    """torch._scaled_mm rowwise: its per-token quantization in plain torch included, or
    (`gemm_only`) on activations quantized beforehand."""
    scale = weight.abs().amax(dim=1) / 448
    codes = (weight / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)

    def run(x: Any, codes_t: torch.Tensor) -> torch.Tensor:
        q, sx = x if gemm_only else quantize_rows(x, fp8=True)
        return torch._scaled_mm(
            q, codes_t, scale_a=sx[:, None], scale_b=scale[None, :].float(),
            out_dtype=torch.bfloat16, use_fast_accum=fast,
        )  # fmt: skip

    stored = [codes.clone() for _ in range(copies)]  # [N, K] row-major: its .T is column-major
    return [functools.partial(run, codes_t=c.T) for c in stored], codes.float() * scale[:, None]


def _tinygemm(weight: torch.Tensor, copies: int) -> tuple[list[Variant], torch.Tensor]:
    """torch's tinygemm int4 kernel (torchao's int4 weight-only path), group 128 asymmetric."""
    n, k = weight.shape
    groups = weight.reshape(n, k // 128, 128)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-6)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    dequant = (codes.float() * scale[..., None] + low[..., None]).reshape(n, k)
    # tinygemm: w = (code - 8) * scale + zero, with zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1)
    scales_and_zeros = scales_and_zeros.contiguous().to(torch.bfloat16)
    flat = codes.reshape(n, k)
    packed_u8 = (flat[:, ::2] << 4 | flat[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    copies_p = [packed.clone() for _ in range(copies)]
    return [
        lambda x, p=p: torch.ops.aten._weight_int4pack_mm(x, p, 128, scales_and_zeros)
        for p in copies_p
    ], dequant


def variants(n: int, k: int, device: torch.device) -> dict[str, tuple[list[Variant], torch.Tensor]]:
    """name -> (callables over rotating weight copies, the float32 weight they multiply by)."""
    weight = torch.randn(n, k, device=device) * 0.02
    bf16 = weight.to(torch.bfloat16).float()
    found: dict[str, tuple[list[Variant], torch.Tensor]] = {}
    makers = {
        "bf16": lambda c: (_dense(weight, torch.bfloat16, c), bf16),
        "llmq_w4a16": lambda c: _llmq("w4a16", n, k, c, device),
        "tinygemm_w4a16": lambda c: _tinygemm(weight, c),
        "llmq_w8a8_int8": lambda c: _llmq("w8a8", n, k, c, device),
        "torch_int8_full": lambda c: _int8_torch(weight, c),
        "llmq_fp8": lambda c: _llmq("fp8", n, k, c, device),
        "torch_fp8_full": lambda c: _fp8_torch(weight, c, fast=False),
        "torch_fp8_full_fast": lambda c: _fp8_torch(weight, c, fast=True),
        "llmq_fp8_gemm": lambda c: _llmq("fp8", n, k, c, device, gemm_only=True),
        "torch_fp8_gemm": lambda c: _fp8_torch(weight, c, fast=False, gemm_only=True),
    }
    for name, make in makers.items():
        bytes_per_copy = n * k * (2 if name == "bf16" else 1)
        try:
            found[name] = make(copies_for(bytes_per_copy, device))
        except Exception as exc:  # a peer path this torch build lacks: report it, go on
            reason = str(exc).splitlines()[0][:160]
            print(f"  {name}: not available ({type(exc).__name__}: {reason})", file=sys.stderr)
    return found


def measure(
    calls: list[Variant],
    weight: torch.Tensor,
    m: int,
    k: int,
    activations: str | None,
    device: torch.device,
    trials: int = 15,
    *,
    prequantized: bool = False,
) -> dict:
    """Check one variant against float32 math on the same (de)quantized operands, then time it.
    activations: "int8" / "fp8" when the variant quantizes them per token, else None;
    `prequantized`: the variant takes them quantized already (outside the timed call)."""
    xs = [torch.randn(m, k, device=device).to(torch.bfloat16) for _ in calls]
    inputs = [quantize_rows(x, fp8=activations == "fp8") for x in xs] if prequantized else xs
    out = calls[0](inputs[0]).float()
    x0 = xs[0].float()
    if activations is not None:
        codes, scale = quantize_rows(xs[0], fp8=activations == "fp8")
        x0 = codes.float() * scale[:, None]
    ref = x0 @ weight.T
    error = ((out - ref).norm() / ref.norm()).item()
    if not error <= TOLERANCE:
        return {"error": error, "us": None}
    seconds = median_seconds(
        [functools.partial(c, x) for c, x in zip(calls, inputs, strict=True)], device, trials=trials
    )
    return {"error": error, "us": seconds * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated NxK (default: the 8B and 70B layers)")
    parser.add_argument("--m", default=",".join(map(str, BATCHES)), help="comma-separated M")
    parser.add_argument("--out", default=str(HERE / "out" / "kernels" / "results.json"))
    parser.add_argument(
        "--device", default="cuda", help="cuda; cpu only smoke-tests this script (no kernel timing)"
    )
    args = parser.parse_args()
    parser_device = torch.device(args.device)
    if parser_device.type == "cuda" and not torch.cuda.is_available():
        print(
            "no GPU here: kernel speed is only measured on a GPU (--device cpu runs a smoke "
            "test of this script on the torch reference paths)",
            file=sys.stderr,
        )
        sys.exit(2)
    device = parser_device
    layers = (
        {s: tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")}
        if args.shapes
        else LAYERS
    )
    batches = [int(v) for v in args.m.split(",")]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke test)"
    results = {"gpu": name, "torch": torch.__version__, "rows": []}
    for label, (n, k) in layers.items():
        found = variants(n, k, device)
        print(f"\n{label} (N={n}, K={k})")
        print("M".rjust(6) + "".join(name.rjust(22) for name in found))
        for m in batches:
            cells, base = [], None
            for name, (calls, weight) in found.items():
                if name == "tinygemm_w4a16" and m > TINYGEMM_MAX_M:
                    cells.append("-".rjust(22))
                    continue
                activations = "fp8" if "fp8" in name else "int8" if "int8" in name else None
                try:
                    row = measure(
                        calls, weight, m, k, activations, device, prequantized=name in GEMM_ONLY
                    )
                except Exception as exc:  # one broken path must not end the run
                    row = {
                        "error": None,
                        "us": None,
                        "failed": f"{type(exc).__name__}: {str(exc)[:300]}",
                    }
                base = row["us"] if name == "bf16" else base
                speedup = base / row["us"] if base and row["us"] else None
                results["rows"].append(
                    {"layer": label, "n": n, "k": k, "m": m, "variant": name, **row,
                     "speedup_vs_bf16": speedup}
                )  # fmt: skip
                cell = "ERR" if row.get("failed") else "WRONG" if row["us"] is None else (
                    f"{row['us']:.1f}" + (f" ({speedup:.2f}x)" if speedup else "")
                )  # fmt: skip
                cells.append(cell.rjust(22))
            print(str(m).rjust(6) + "".join(cells), flush=True)
        out = Path(args.out)  # written after every shape: a run cut short keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
