"""The importance matrix: per input channel of each linear, the mean square of its input over
calibration text — llama.cpp's `llama-imatrix` statistic, computed by llmq's own calibration, and
read and written in llama.cpp's file format so that either tool can use the other's.

The file is a GGUF with `general.type = "imatrix"`: for each weight, by its GGUF name,
`<name>.in_sum2` (the sums of squares, float32 [channels, 1]) and `<name>.counts` (the tokens
summed, float32 [1, 1]); `imatrix.datasets`, `imatrix.chunk_count` and `imatrix.chunk_size`
say what it was computed on. A reader divides the sums by the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from llmq.calib.stats import CalibStats
from llmq.config import CalibConfig
from llmq.errors import InputError
from llmq.gguf.model import EXPERT_INDEX, TensorNames, gguf_arch, read_field
from llmq.io.atomic import check_output_file, partial_file
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress


@dataclass(slots=True)
class Imatrix:
    """Sums of squared inputs and token counts, by GGUF weight name. A mixture's stacked
    experts have one row of sums and one count per expert ([experts, cols], [experts]), as
    llama.cpp's files hold them."""

    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]  # [1] for a plain weight, [experts] for stacked ones
    arch: str = ""  # the model's GGUF architecture, when known
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0

    def importance(self) -> dict[str, np.ndarray]:
        """Each weight's mean squared input per channel (what the scale search weighs by)."""
        importance = {}
        for name, total in self.sums.items():
            counts = np.maximum(self.counts[name], 1.0)
            per_row = total / counts[:, None] if total.ndim == 2 else total / counts[0]
            importance[name] = per_row.astype(np.float32)
        return importance


def imatrix_from_calibration(
    ckpt: Checkpoint,
    calibration: CalibConfig,
    *,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> Imatrix:
    """The float model's linear inputs over the calibration windows, layer by layer (llmq's
    calibration pass, sums of squares only; GPTQ's Hessians: llmq.gguf.statistics)."""
    from llmq.calib.collect import collect_stats
    from llmq.calib.windows import model_windows

    windows = model_windows(ckpt.path, calibration, progress)
    stats = collect_stats(ckpt, windows.input_ids, norms=True, progress=progress, device=device)
    return imatrix_from_stats(ckpt, stats, calibration)


def imatrix_from_stats(ckpt: Checkpoint, stats: CalibStats, calibration: CalibConfig) -> Imatrix:
    """The imatrix of statistics collected with sums of squares (`collect_stats(norms=True)`),
    under the GGUF names of `ckpt`'s weights."""
    arch = gguf_arch(ckpt.config)
    names = TensorNames(arch, ckpt.num_layers)
    rows: dict[str, dict[int, tuple[np.ndarray, float]]] = {}  # per GGUF name, per expert
    for linear, observed in stats.inputs.items():
        assert observed.sq_sum is not None
        expert = EXPERT_INDEX.search(linear)
        row = (observed.sq_sum.double().cpu().numpy(), float(observed.num_tokens))
        rows.setdefault(names.gguf_name(f"{linear}.weight"), {})[int(expert.group(1)) if expert else -1] = row  # fmt: skip
    sums, counts = {}, {}
    for name, by_expert in rows.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        stacked = -1 not in by_expert
        sums[name] = np.stack([r[0] for r in ordered]) if stacked else ordered[0][0]
        counts[name] = np.array([r[1] for r in ordered])
    return Imatrix(
        sums, counts, gguf.MODEL_ARCH_NAMES[arch.arch], datasets=(calibration.text,),
        chunk_count=calibration.num_samples, chunk_size=calibration.seq_len,
    )  # fmt: skip


def save_imatrix(path: Path, imatrix: Imatrix) -> None:
    """Write `imatrix` in llama.cpp's format (the file `llama-quantize --imatrix` reads)."""
    with partial_file(path) as partial:
        writer = gguf.GGUFWriter(partial, arch=imatrix.arch or "unknown")
        writer.add_type(gguf.GGUFType.IMATRIX)
        writer.add_array(gguf.Keys.IMatrix.DATASETS, list(imatrix.datasets))
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, imatrix.chunk_count)
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, imatrix.chunk_size)
        for name in sorted(imatrix.sums):  # [matrices, cols] and [matrices, 1]: one, or experts
            sums = imatrix.sums[name].astype(np.float32)
            writer.add_tensor(f"{name}.in_sum2", sums.reshape(-1, sums.shape[-1]))
            writer.add_tensor(f"{name}.counts", imatrix.counts[name].astype(np.float32)[:, None])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def check_imatrix_output(path: Path, *, overwrite: bool) -> None:
    """Refuse an existing file without `overwrite`, and even with it any file but an imatrix."""
    check_output_file(path, overwrite=overwrite, ours=_is_imatrix, kind="an imatrix file")


def _is_imatrix(path: Path) -> bool:
    return read_field(path, gguf.Keys.General.TYPE) == gguf.GGUFType.IMATRIX


def read_imatrix(path: Path) -> Imatrix:
    """An imatrix file written by llmq or by llama.cpp's `llama-imatrix` (GGUF format)."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable GGUF imatrix file ({exc})") from None
    kind = reader.get_field(gguf.Keys.General.TYPE)
    if kind is None or kind.contents() != gguf.GGUFType.IMATRIX:
        raise InputError(f"{path}: a GGUF file, but not an imatrix (general.type)")
    tensors = {tensor.name: np.asarray(tensor.data, dtype=np.float64) for tensor in reader.tensors}
    sums, counts = {}, {}
    for key, data in tensors.items():
        if key.endswith(".in_sum2"):
            name = key.removesuffix(".in_sum2")
            count = tensors.get(f"{name}.counts")
            if count is None:
                raise InputError(f"{path}: {name} has sums but no counts")
            if data.size % count.size:
                raise InputError(f"{path}: {name} has {data.size} sums for {count.size} counts")
            per_row = data.reshape(count.size, -1)  # one row per expert of a stacked weight
            sums[name] = per_row[0] if count.size == 1 else per_row
            counts[name] = count.reshape(-1)
    datasets = reader.get_field(gguf.Keys.IMatrix.DATASETS)
    return Imatrix(sums, counts, datasets=() if datasets is None else tuple(datasets.contents()))
