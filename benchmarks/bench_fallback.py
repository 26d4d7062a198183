"""Does `fallback-scan` predict real damage, and is it fast? Three measurements, one script.

damage: every linear of the default model (SmolLM2-135M-Instruct, fp32) is quantized alone
  (INT8 per-tensor, then INT4 g64) and the perplexity increase it causes is measured on held-out
  pydoc. The scan's score for each linear is then rank-correlated (Spearman) with that damage,
  and the share of the total damage that the top-k scored linears account for is compared with
  the best possible top-k. Scores: the scan's NRMSE; its spread ratio; and an activation-weighted
  NRMSE, sqrt(sum_j ||dW_j||^2 E[x_j^2] / sum_j ||W_j||^2 E[x_j^2]) with E[x_j^2] from
  calibration windows (pydoc calibration split, disjoint from the held-out text).
auto: `quantize --fallback` at a few NRMSE thresholds against plain quantization: perplexity
  (held-out pydoc and Hamlet) and checkpoint size.
speed: scan throughput against a plain read of the same files (safetensors, sum every tensor),
  with the page cache dropped for the files (cold) and warm; and against a naive exact scan
  (load, upcast to float32, sort for the quartiles, quantize, norm), whose numbers must match.
  On the default model and on a synthetic 2.5 GB bf16 checkpoint with a 262M-element tensor.

    python benchmarks/bench_fallback.py [--only damage,auto,speed] [--out benchmarks/out/fallback]

Perplexity protocol (damage): token perplexity, held-out pydoc, the first --damage-windows x 256
tokens, no BOS, float32. (auto): the benchmarks' standard protocol, 12 x 512 tokens of held-out
pydoc and Hamlet, no BOS, float32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import held_out_perplexity, machine, ppl_cells, protocol, write_json

HERE = Path(__file__).resolve().parent


def _model_folder() -> Path:
    from llmq.models import resolve_model

    return resolve_model("smollm2-135m")


# --- damage -----------------------------------------------------------------------------------


def _spearman(a: list[float], b: list[float]) -> float:
    import torch

    def ranks(values: list[float]) -> torch.Tensor:
        order = torch.tensor(values, dtype=torch.float64).argsort()
        out = torch.empty(len(values), dtype=torch.float64)
        out[order] = torch.arange(len(values), dtype=torch.float64)
        return out

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _top_k_share(scores: list[float], damage: list[float], k: int) -> tuple[float, float]:
    """Share of the total (positive) damage in the top-k by score, and the best possible."""
    positive = [max(d, 0.0) for d in damage]
    total = sum(positive) or 1.0
    by_score = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
    best = sorted(positive, reverse=True)[:k]
    return sum(positive[i] for i in by_score) / total, sum(best) / total


class _Evaluator:
    """Loss of the model on fixed windows, re-running only the layers from the changed one on."""

    def __init__(self, folder: Path, windows: int, seq_len: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from llmq.calib.data import evaluation_windows
        from llmq.calib.tokenizer import load_tokenizer

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = load_tokenizer(folder)
        self.ids = evaluation_windows(tokenizer, "pydoc", seq_len=seq_len, max_windows=windows).input_ids  # fmt: skip
        self.layers = self.model.model.layers
        with torch.inference_mode():
            out = self.model(self.ids, output_hidden_states=True, use_cache=False)
        self.hidden = [h.clone() for h in out.hidden_states[: len(self.layers)]]
        self.base_logprobs = self._logprobs(out.logits)
        self.base_nll = self._nll(self.base_logprobs)

    def _logprobs(self, logits: object) -> object:
        import torch

        flat = logits[:, :-1].reshape(-1, logits.shape[-1])  # type: ignore[index]
        return torch.log_softmax(flat.float(), dim=-1)

    def _nll(self, logprobs: object) -> float:
        targets = self.ids[:, 1:].reshape(-1, 1)
        return float(-logprobs.gather(1, targets).mean())  # type: ignore[attr-defined]

    def damage_from_layer(self, index: int) -> tuple[float, float]:
        """(mean token NLL, mean KL(float || changed) per token), re-running layers index..end."""
        import torch

        self.model.model.layers = torch.nn.ModuleList(list(self.layers)[index:])
        try:
            with torch.inference_mode():
                logits = self.model(inputs_embeds=self.hidden[index], use_cache=False).logits
        finally:
            self.model.model.layers = self.layers
        logprobs = self._logprobs(logits)
        kl = (self.base_logprobs.exp() * (self.base_logprobs - logprobs)).sum(-1).mean()
        return self._nll(logprobs), float(kl)


DAMAGE_SCHEMES = {"int8-tensor": ("int8-tensor", None), "int4-g64": ("w4a16", 64)}
"""label -> (fallback-scan --scheme, --group-size)"""


def _damage_args(label: str) -> object:
    from llmq.config import with_group_size
    from llmq.fallback.options import scan_args

    scheme, group_size = DAMAGE_SCHEMES[label]
    return with_group_size(scan_args(scheme), group_size)


def measure_damage(out: Path, windows: int) -> dict:
    """Perplexity increase and KL(float || quantized) of each linear quantized alone."""
    import torch

    from llmq.quant.primitives import quantize_weight

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    evaluator = _Evaluator(_model_folder(), windows, 256)
    names = [
        f"model.layers.{i}.{suffix}"
        for i in range(len(evaluator.layers))
        for suffix in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]  # fmt: skip
    results = {"base_ppl": math.exp(evaluator.base_nll), "windows": windows, "schemes": {}}
    for label in DAMAGE_SCHEMES:
        args = _damage_args(label)
        rows = []
        for name in names:
            module = evaluator.model.get_submodule(name)
            original = module.weight.data.clone()
            module.weight.data = quantize_weight(original, args).dequantize(torch.float32)
            nll, kl = evaluator.damage_from_layer(int(name.split(".")[2]))
            module.weight.data = original
            rows.append({"name": name, "damage": math.exp(nll - evaluator.base_nll) - 1, "kl": kl})
            print(f"{label} {name}: damage {rows[-1]['damage']:+.4%} kl {kl:.2e}", flush=True)
        results["schemes"][label] = {"rows": rows}
        write_json(out / "damage.json", results)
    return results


def score_damage(out: Path, results: dict) -> dict:
    """The scan's scores for each linear (plain, and with calibration statistics) against the
    measured damage: Spearman correlation and the damage share of the top-k."""
    import llmq

    folder = _model_folder()
    stats = _calibration_stats(out)
    for label, (scheme, group_size) in DAMAGE_SCHEMES.items():
        plain = _by_module(llmq.fallback_scan(folder, scheme=scheme, group_size=group_size, workers=2))  # fmt: skip
        calibrated = _by_module(llmq.fallback_scan(folder, scheme=scheme, group_size=group_size, calib_stats=stats, workers=2))  # fmt: skip
        block = results["schemes"][label]
        for row in block["rows"]:
            name = row["name"]
            row |= {"nrmse": plain[name].stats.nrmse, "ratio": plain[name].stats.spread_ratio,
                    "weighted_nrmse": calibrated[name].stats.weighted_nrmse,
                    "error_share": calibrated[name].error_share}  # fmt: skip
        summary: dict = {}
        for target in ("damage", "kl"):
            measured = [r[target] for r in block["rows"]]
            for score in ("nrmse", "ratio", "weighted_nrmse", "error_share"):
                values = [r[score] for r in block["rows"]]
                summary[f"{score} vs {target}"] = {
                    "spearman": _spearman(values, measured),
                    **{f"top{k}": _top_k_share(values, measured, k) for k in (5, 10, 20)},
                }
        block["summary"] = summary
    write_json(out / "damage.json", results)
    return results


def _by_module(report: object) -> dict:
    return {t.name.removesuffix(".weight"): t for t in report.tensors}  # type: ignore[attr-defined]


def _calibration_stats(out: Path) -> Path:
    """E[x^2] per linear input (Hessian diagonals) on 16 x 256 pydoc calibration tokens."""
    import llmq

    stats = out / "calib-pydoc-16x256.safetensors"
    if not stats.exists():
        llmq.calibrate(_model_folder(), stats, calib_text="pydoc", num_samples=16, seq_len=256, hessian=True)  # fmt: skip
    return stats


def damage_markdown(results: dict) -> str:
    lines = [
        f"Per-linear damage: {len(next(iter(results['schemes'].values()))['rows'])} linears, each "
        f"quantized alone; base perplexity {results['base_ppl']:.3f} on {results['windows']} x 256 "
        "tokens of held-out pydoc (no BOS, float32).",
        "",
        "| scheme | score vs measured damage | Spearman | top-5 share (best) | top-10 share (best) | top-20 share (best) |",
        "|---|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for label, block in results["schemes"].items():
        for score, s in block["summary"].items():
            cells = " | ".join(
                f"{s[f'top{k}'][0]:.0%} ({s[f'top{k}'][1]:.0%})" for k in (5, 10, 20)
            )
            lines.append(f"| {label} | {score} | {s['spearman']:.3f} | {cells} |")
    return "\n".join(lines)


# --- auto -------------------------------------------------------------------------------------


def _threshold_keeping(report: object, k: int) -> float:
    """An NRMSE threshold that flags exactly the k worst-scored decoder linears."""
    scores = sorted(
        (t.score for t in report.tensors if t.score is not None and ".layers." in t.name and t.kind != "norm"),  # type: ignore[attr-defined]
        reverse=True,
    )  # fmt: skip
    return (scores[k - 1] + scores[k]) / 2


def run_auto(out: Path, windows: int) -> list[dict]:
    """W4A16 g64 RTN: plain; `--fallback auto` with its default thresholds and with NRMSE
    thresholds that keep the 3, 10 and 25 worst linears; `--fallback REPORT` from scans with
    calibration statistics (`fallback-scan --calib-stats`, ranked by output error share)
    keeping as many."""
    from common import llmq_quantize_cmd, run_measured

    import llmq
    from llmq.io.atomic import write_json as atomic_json

    folder = _model_folder()
    base = ["--scheme", "w4a16", "--group-size", "64", "--skip-layer-check"]
    stats = _calibration_stats(out)
    configs: list[tuple[str, list[str]]] = [("plain", []), ("--fallback auto (defaults)", ["--fallback", "auto"])]  # fmt: skip
    scan = {"scheme": "w4a16", "group_size": 64, "workers": 2}  # spread ratio > 60 flags too
    nrmse_scan = llmq.fallback_scan(folder, **scan)
    for k in (3, 10, 25):
        threshold = _threshold_keeping(nrmse_scan, k)
        configs.append((f"auto, NRMSE > {threshold:.4g}", ["--fallback", "auto", "--fallback-threshold", f"{threshold:.6g}"]))  # fmt: skip
    configs.append(("--fallback auto --calib-stats (defaults)", ["--fallback", "auto", "--calib-stats", str(stats)]))  # fmt: skip
    share_scan = llmq.fallback_scan(folder, calib_stats=stats, **scan)
    for k in (3, 10, 25):
        threshold = _threshold_keeping(share_scan, k)
        report = llmq.fallback_scan(folder, calib_stats=stats, error_share_threshold=threshold, **scan)  # fmt: skip
        report_file = out / f"scan-error-share-{k}.json"
        atomic_json(report_file, report.to_dict())
        configs.append((f"report, error share > {threshold:.3g}", ["--fallback", str(report_file)]))  # fmt: skip
    rows = []
    for label, options in configs:
        target = out / ("auto-" + "".join(c if c.isalnum() else "-" for c in label))
        measured = run_measured(llmq_quantize_cmd(folder, target, base + options))
        result = json.loads(measured.stdout)
        size = sum(p.stat().st_size for p in target.glob("*.safetensors"))
        rows.append({"config": label, "kept": len((result.get("fallback") or {}).get("kept", [])),
                     "size_bytes": size, "wall_s": measured.wall_s,
                     "ppl": held_out_perplexity(target, folder, windows)})  # fmt: skip
        print(rows[-1], flush=True)
        write_json(out / "auto.json", rows)
    return rows


def auto_markdown(rows: list[dict], windows: int) -> str:
    lines = [
        "W4A16 g64 RTN (`--skip-layer-check`), plain and with `--fallback` keeping the k worst linears by "
        "each score (int4 g64 scan; error share: E[x^2] from `llmq calibrate --hessian` on 16 x 256 pydoc "
        f"calibration tokens). Protocol: {protocol(windows)}.",
        "",
        "| fallback | linears kept | size MB | held-out pydoc | Hamlet |",
        "|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for row in rows:
        lines.append(f"| {row['config']} | {row['kept']} | {row['size_bytes'] / 1e6:.1f} | {ppl_cells(row)} |")  # fmt: skip
    return "\n".join(lines)


# --- speed ------------------------------------------------------------------------------------


def _evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (so the next read comes from disk)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(files: list[Path]) -> float:
    """Read every tensor once with safetensors and sum it: the reference read speed."""
    from safetensors import safe_open

    started = time.perf_counter()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                handle.get_tensor(name).sum()
    return time.perf_counter() - started


def naive_scan(files: list[Path], args: object) -> dict[str, dict[str, float]]:
    """The obvious exact scan: load, upcast to float32, sort for quartiles, quantize, norm."""
    import torch
    from safetensors import safe_open

    from llmq.fallback.quant_error import scale_dtype_for
    from llmq.quant.primitives import quantize_weight

    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                tensor = handle.get_tensor(name)
                x = tensor.to(torch.float32)
                ordered = x.reshape(-1).sort().values
                n = ordered.numel()
                quartiles = []
                for q in (0.25, 0.75):
                    pos = q * (n - 1)
                    low, high = float(ordered[math.floor(pos)]), float(ordered[math.ceil(pos)])
                    quartiles.append(low + (high - low) * (pos - math.floor(pos)))
                rows = x.reshape(1, -1)  # per-tensor scheme: one row is the whole tensor
                restored = quantize_weight(rows, args, scale_dtype=scale_dtype_for(tensor.dtype)).dequantize()  # fmt: skip
                error = torch.linalg.vector_norm((rows - restored).double())
                nrmse = float(error / torch.linalg.vector_norm(rows.double()))
                out[name] = {"q1": quartiles[0], "q3": quartiles[1], "nrmse": nrmse}
    return out


def make_synthetic(folder: Path) -> list[Path]:
    """A 2.5 GB bf16 checkpoint in two shards: a 128256 x 2048 embedding (262M values, over
    torch.quantile's 16M limit) and 40 layers of projection weights with a few outliers."""
    import torch
    from safetensors.torch import save_file

    shards = [folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"]  # fmt: skip
    if all(s.is_file() for s in shards):
        return shards
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=generator) * 0.02
        w[torch.randint(0, rows, (8,), generator=generator), torch.randint(0, cols, (8,), generator=generator)] = 0.9  # fmt: skip
        return w.to(torch.bfloat16)

    first = {"model.embed_tokens.weight": weight(128256, 2048)}
    for i in range(20):
        first |= {f"model.layers.{i}.mlp.up_proj.weight": weight(5632, 2048),
                  f"model.layers.{i}.mlp.down_proj.weight": weight(2048, 5632)}  # fmt: skip
    save_file(first, str(shards[0]))
    del first
    second = {}
    for i in range(20, 40):
        second |= {f"model.layers.{i}.self_attn.q_proj.weight": weight(2048, 2048),
                   f"model.layers.{i}.mlp.up_proj.weight": weight(5632, 2048),
                   f"model.layers.{i}.mlp.down_proj.weight": weight(2048, 5632)}  # fmt: skip
    save_file(second, str(shards[1]))
    return shards


def run_speed(out: Path, synthetic_dir: Path, naive: bool, repeat: int) -> list[dict]:
    from common import run_measured

    import llmq
    from llmq.fallback.inventory import safetensors_files
    from llmq.fallback.options import scan_args
    from llmq.io.checkpoint import DTYPE_BYTES

    rows = []
    targets = {"default model (fp32, 0.54 GB)": _model_folder(),
               "synthetic bf16 (2.5 GB)": synthetic_dir}  # fmt: skip
    make_synthetic(synthetic_dir)
    for label, folder in targets.items():
        files = safetensors_files(folder)
        size = sum(f.stat().st_size for f in files)
        row: dict = {"target": label, "bytes": size}
        for cache in ("cold", "warm"):
            samples: dict[str, list[float]] = {"read": [], "scan": []}
            for _ in range(repeat):  # storage speed varies run to run: alternate, take medians
                for what in ("read", "scan"):
                    if cache == "cold":
                        _evict(files)
                    else:
                        plain_read(files)  # bring the files into the page cache
                    started = time.perf_counter()
                    if what == "read":
                        plain_read(files)
                    else:
                        report = llmq.fallback_scan(folder, workers=2)
                    samples[what].append(time.perf_counter() - started)
            row[cache] = {what: statistics.median(values) for what, values in samples.items()}
            row[f"{cache}_samples"] = samples
            print(label, cache, samples, flush=True)
        cli = run_measured([sys.executable, "-m", "llmq.cli.main", "fallback-scan", str(folder), "--workers", "2", "--json"])  # fmt: skip
        largest = max(t.stats.numel * DTYPE_BYTES[t.dtype] for t in report.tensors)
        row["cli"] = {"wall_s": cli.wall_s, "peak_rss_bytes": cli.peak_rss_bytes, "largest_tensor_bytes": largest}  # fmt: skip
        print(label, "cli", row["cli"], flush=True)
        if naive:
            started = time.perf_counter()
            reference = naive_scan(files, scan_args("int8-tensor"))
            row["naive_s"] = time.perf_counter() - started
            started = time.perf_counter()
            report = llmq.fallback_scan(folder, workers=1)
            row["scan_1_worker_s"] = time.perf_counter() - started
            row["identical"] = _compare(report, reference)
            print(label, "naive", row["naive_s"], "scan 1 worker", row["scan_1_worker_s"], row["identical"], flush=True)  # fmt: skip
        rows.append(row)
        write_json(out / "speed.json", rows)
    return rows


def _compare(report: object, reference: dict) -> dict:
    """Quartiles must be bit-identical; NRMSE equal up to float summation order."""
    worst_nrmse, quartiles_equal = 0.0, True
    for scan in report.tensors:  # type: ignore[attr-defined]
        expected = reference[scan.name]
        stats = scan.stats
        quartiles_equal &= (stats.q1, stats.q3) == (expected["q1"], expected["q3"])
        worst_nrmse = max(worst_nrmse, abs(stats.nrmse / expected["nrmse"] - 1) if expected["nrmse"] else abs(stats.nrmse))  # fmt: skip
    return {"quartiles_bit_identical": quartiles_equal, "nrmse_max_rel_diff": worst_nrmse}


def speed_markdown(rows: list[dict]) -> str:
    lines = [
        "| files | largest tensor MB | `llmq fallback-scan --workers 2` wall s (whole process) | peak RSS MB | RSS / (2 workers x largest tensor) |",
        "|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in rows:
        cli = r["cli"]
        lines.append(
            f"| {r['target']} | {cli['largest_tensor_bytes'] / 1e6:.0f} | {cli['wall_s']:.2f} | "
            f"{cli['peak_rss_bytes'] / 1e6:.0f} | {cli['peak_rss_bytes'] / (2 * cli['largest_tensor_bytes']):.2f} |"
        )
    lines += [
        "",
        "Medians of alternating runs; ratio = plain read time / scan time (the scan's speed as a share of the read's).",
        "",
        "| files | size GB | plain read cold s | scan cold s | ratio cold | plain read warm s | scan warm s | ratio warm | naive exact s | scan 1 worker s | speed-up vs naive | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for r in rows:
        cold, warm = r["cold"], r["warm"]
        naive = f"{r['naive_s']:.1f} | {r['scan_1_worker_s']:.2f} | {r['naive_s'] / r['scan_1_worker_s']:.1f}x | quartiles {'bit-identical' if r['identical']['quartiles_bit_identical'] else 'DIFFER'}, NRMSE max rel diff {r['identical']['nrmse_max_rel_diff']:.1e}" if "naive_s" in r else "- | - | - | -"  # fmt: skip
        lines.append(
            f"| {r['target']} | {r['bytes'] / 1e9:.2f} | {cold['read']:.2f} | {cold['scan']:.2f} | "
            f"{cold['read'] / cold['scan']:.0%} | {warm['read']:.3f} | {warm['scan']:.2f} | "
            f"{warm['read'] / warm['scan']:.0%} | {naive} |"
        )
    return "\n".join(lines)


def print_saved_tables(out: Path, parts: list[str], windows: int) -> None:
    saved = {"damage": (damage_markdown, "damage.json"), "auto": (lambda r: auto_markdown(r, windows), "auto.json"),
             "speed": (speed_markdown, "speed.json")}  # fmt: skip
    for part in parts:
        markdown, name = saved[part]
        if (out / name).is_file():
            print(markdown(json.loads((out / name).read_text())), end="\n\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="damage,auto,speed")
    parser.add_argument("--out", type=Path, default=HERE / "out" / "fallback")
    parser.add_argument("--damage-windows", type=int, default=4)
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--synthetic", type=Path, default=HERE / "out" / "synthetic-bf16")
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--repeat", type=int, default=5, help="speed: timings per cell (median)")
    parser.add_argument("--tables", action="store_true", help="print the tables of saved results")
    parser.add_argument("--rescore", action="store_true",
                        help="damage: score the saved measurements again, do not re-measure")  # fmt: skip
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    parts = options.only.split(",")
    if options.tables:
        print_saved_tables(options.out, parts, options.windows)
        return
    print(f"# {time.strftime('%Y-%m-%d')} on {machine()}")
    if "damage" in parts:
        saved = options.out / "damage.json"
        if options.rescore and saved.is_file():
            measured = json.loads(saved.read_text())
        else:
            measured = measure_damage(options.out, options.damage_windows)
        print(damage_markdown(score_damage(options.out, measured)))
    if "auto" in parts:
        print(auto_markdown(run_auto(options.out, options.windows), options.windows))
    if "speed" in parts:
        print(
            speed_markdown(
                run_speed(options.out, options.synthetic, not options.no_naive, options.repeat)
            )
        )


if __name__ == "__main__":
    main()
