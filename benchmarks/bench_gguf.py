"""GGUF k-quants: llmq's files against llama.cpp's own quantizer at the same scheme, all scored
by llama.cpp's `llama-perplexity` (perplexity, and KL divergence from the float GGUF) on held-out
text, in one run.

Rows per scheme (Q4_K_M, Q5_K_M, Q6_K by default), `--variants` picks some:
- llama.cpp-plain / llama.cpp-imatrix: `llama-quantize` from the float GGUF its converter
  writes, without and with an importance matrix from `llama-imatrix`;
- llmq-plain / llmq-imatrix: `llmq quantize --format gguf` from the safetensors, without
  (`--imatrix none`) and with its own importance matrix, computed once and reused;
- llmq-gptq: `--method gptq`, GPTQ's error feedback on the searched grid, from a calibration
  pass over the same text (its Hessians and imatrix);
- llmq-mixed: `--target-bits B`, each decoder tensor's type chosen from q4_k/q5_k/q6_k/q8_0 by
  measured sensitivity (auto: gradient, 8 of the calibration windows), B the bits a weight of
  the decoder's tensors in llama.cpp-imatrix's file of the scheme (same size or smaller); the
  scheme's types elsewhere and llmq's importance matrix, as llmq-imatrix.
Setup steps whose results exist in --out (the float GGUF, the perplexity bases, the imatrices)
are reused; report.json gathers rows across runs.
Both imatrices read the same text: llmq's 128 x 512-token calibration windows (seed 0) of the
default text, decoded and written out; llama-imatrix reads it as 128 consecutive 512-token chunks,
llmq samples 128 windows of 512 from it.

    python benchmarks/bench_gguf.py [--model smollm2-135m] [--schemes q4_k_m q5_k_m q6_k]
        [--chunks 20] [--out benchmarks/out/gguf]

Needs llama.cpp built by benchmarks/peers/setup_llamacpp.sh (a peer, never a dependency).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMACPP = HERE / ".venvs" / "llamacpp" / "llama.cpp"
BIN = LLAMACPP / "build" / "bin"
CONVERTER_PYTHON = HERE / ".venvs" / "llamacpp" / "venv" / "bin" / "python"
VARIANTS = ("llama.cpp-plain", "llama.cpp-imatrix", "llmq-plain", "llmq-imatrix", "llmq-gptq", "llmq-mixed")  # fmt: skip
HELD_OUT = ("news", "shakespeare")  # held-out splits: news articles; Hamlet


def run(cmd: list[str], log: Path) -> float:
    """Run `cmd`, its output into `log`; the wall seconds. A failure stops the benchmark."""
    started = time.perf_counter()
    with log.open("w") as handle:
        done = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return time.perf_counter() - started


def once(report: dict, step: str, result: Path, work) -> None:
    """Run a setup step unless its result is there from an earlier run; record its seconds."""
    if not result.exists():
        report["seconds"][step] = round(work(), 1)


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def write_texts(model: Path, out: Path, samples: int, seq_len: int) -> tuple[Path, dict]:
    """The calibration text (llmq's windows, decoded) and each held-out text, as files."""
    from llmq.calib.data import calibration_windows
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.texts import DEFAULT_CALIBRATION_TEXT, builtin_documents

    tokenizer = load_tokenizer(model)
    windows = calibration_windows(
        tokenizer, DEFAULT_CALIBRATION_TEXT, num_samples=samples, seq_len=seq_len, seed=0
    )
    from transformers import AutoTokenizer

    decoder = AutoTokenizer.from_pretrained(model)
    calib = out / "calibration.txt"
    calib.write_text("".join(decoder.decode(row) for row in windows.input_ids.tolist()))
    held = {}
    for name in HELD_OUT:
        held[name] = out / f"heldout-{name}.txt"
        held[name].write_text("\n\n".join(builtin_documents(name, "heldout")))
    return calib, held


def score(
    gguf: Path, held: dict[str, Path], bases: dict[str, Path], chunks: int, log: Path
) -> dict:
    """llama-perplexity's perplexity and mean KL divergence from the float model, per text."""
    scores = {}
    for name, text in held.items():
        cmd = [str(BIN / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", "512",
               "--chunks", str(chunks), "-t", "2", "--kl-divergence-base", str(bases[name]),
               "--kl-divergence"]  # fmt: skip
        run(cmd, log)
        output = log.read_text()
        ppl = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", output)
        kld = re.search(r"Mean\s+KLD:\s*([\d.]+)", output)
        if ppl is None or kld is None:
            sys.exit(f"no perplexity in {log}")
        scores[name] = {"ppl": float(ppl.group(1)), "kld": float(kld.group(1))}
    return scores


def decoder_bits(path: Path) -> float:
    """The bits a weight of a GGUF file's decoder matrices (blk.*, 2-D) take."""
    import gguf
    import numpy as np

    tensors = [t for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2]  # fmt: skip
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(np.prod(t.shape)) for t in tensors)


def peer_bits(out: Path, scheme: str) -> float:
    """The decoder's bits a weight in llama.cpp's imatrix file of `scheme`: llmq-mixed's budget."""
    peer = out / f"llama.cpp-imatrix-{scheme}.gguf"
    if not peer.exists():
        sys.exit(f"llmq-mixed matches {peer.name}'s size: run llama.cpp-imatrix first")
    return decoder_bits(peer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--schemes", nargs="+", default=["q4_k_m", "q5_k_m", "q6_k"])
    parser.add_argument("--chunks", type=int, default=20, help="512-token chunks per text")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=HERE / "out" / "gguf")
    args = parser.parse_args()
    if not (BIN / "llama-quantize").exists():
        sys.exit("llama.cpp is not built: bash benchmarks/peers/setup_llamacpp.sh")
    from llmq.config import CalibConfig
    from llmq.gguf.imatrix import imatrix_from_calibration, save_imatrix
    from llmq.io.checkpoint import open_checkpoint
    from llmq.models import resolve_model

    model = resolve_model(args.model)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    calib, held = write_texts(model, out, args.samples, 512)
    report_path = out / "report.json"
    report: dict = json.loads(report_path.read_text()) if report_path.exists() else {
        "model": args.model, "chunks": args.chunks, "rows": [], "seconds": {}, "float": {}}  # fmt: skip
    f32 = out / "f32.gguf"
    converter = [str(CONVERTER_PYTHON), str(LLAMACPP / "convert_hf_to_gguf.py"), str(model),
                 "--outtype", "f32", "--outfile", str(f32)]  # fmt: skip
    once(report, "convert_f32", f32, lambda: run(converter, out / "convert.log"))
    bases = {}
    for name, text in held.items():
        bases[name], log = out / f"base-{name}.kld", out / f"base-{name}.log"
        once(report, f"base_{name}", bases[name], lambda text=text, name=name, log=log: run(
            [str(BIN / "llama-perplexity"), "-m", str(f32), "-f", str(text), "-c", "512",
             "--chunks", str(args.chunks), "-t", "2", "--kl-divergence-base", str(bases[name])],
            log))  # fmt: skip
        found = re.search(r"Final estimate: PPL = ([\d.]+)", log.read_text())
        report["float"][name] = float(found.group(1)) if found else None
    peer_imatrix, llmq_imatrix = out / "llamacpp.imatrix", out / "llmq.imatrix"
    once(report, "llama_imatrix", peer_imatrix, lambda: run(
        [str(BIN / "llama-imatrix"), "-m", str(f32), "-f", str(calib), "-c", "512",
         "--chunks", str(args.samples), "-t", "2", "-o", str(peer_imatrix)],
        out / "llama-imatrix.log"))  # fmt: skip
    calibration = CalibConfig(text=str(calib), num_samples=args.samples, seq_len=512)
    once(report, "llmq_imatrix", llmq_imatrix, lambda: timed(lambda: save_imatrix(
        llmq_imatrix, imatrix_from_calibration(open_checkpoint(model), calibration))))  # fmt: skip
    calib_options = ["--calib-text", str(calib), "--num-samples", str(args.samples),
                     "--seq-len", "512"]  # fmt: skip
    for scheme in args.schemes:
        for variant in args.variants:
            label = f"{variant}-{scheme}"
            path = out / f"{label}.gguf"
            if variant.startswith("llama.cpp"):
                imatrix = ["--imatrix", str(peer_imatrix)] if variant.endswith("imatrix") else []
                cmd = [str(BIN / "llama-quantize"), *imatrix, str(f32), str(path), scheme.upper(), "2"]  # fmt: skip
            else:
                how = {"llmq-plain": ["--imatrix", "none"],
                       "llmq-imatrix": ["--imatrix", str(llmq_imatrix)],
                       "llmq-gptq": ["--method", "gptq", *calib_options]}.get(variant)  # fmt: skip
                if variant == "llmq-mixed":
                    bits = f"{peer_bits(out, scheme):.6f}"
                    how = ["--imatrix", str(llmq_imatrix), "--target-bits", bits, *calib_options]
                cmd = [sys.executable, "-m", "llmq", "quantize", str(model), "--out", str(path),
                       "--format", "gguf", "--scheme", scheme, *(how or []), "--overwrite"]  # fmt: skip
            seconds = run(cmd, out / f"{label}.log")
            row = {"variant": variant, "scheme": scheme, "bytes": path.stat().st_size,
                   "decoder_bits": round(decoder_bits(path), 4), "seconds": round(seconds, 1),
                   "scores": score(path, held, bases, args.chunks, out / f"{label}-ppl.log")}  # fmt: skip
            print(json.dumps(row), flush=True)
            report["rows"] = [r for r in report["rows"] if (r.get("variant"), r["scheme"]) != (variant, scheme)]  # fmt: skip
            report["rows"].append(row)
            report_path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
