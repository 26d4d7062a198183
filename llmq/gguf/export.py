"""Write a checkpoint as one GGUF file: each tensor read, encoded and written in turn, so memory
stays near the largest tensor whatever the model's size.

The file is written under a temporary name beside OUT and renamed when complete; an existing
OUT is replaced only with `overwrite`, and only when llmq wrote it (its `general.quantized_by`
says so): a user's own GGUF is never replaced.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from torch import Tensor

from llmq.gguf import mla
from llmq.gguf.blocks import codes_for, dequantized, pack
from llmq.gguf.gptq import gptq_codes
from llmq.gguf.grids import choose_grid
from llmq.gguf.mix import GGUFScheme, choose_type
from llmq.gguf.model import (
    EXPERT_INDEX,
    VECTORS,
    TensorNames,
    gguf_arch,
    gguf_layer,
    llama3_rope_factors,
    permute_rotary_rows,
    read_field,
    rope_of,
    write_hyperparameters,
)
from llmq.gguf.statistics import FixedStatistics, Statistics
from llmq.gguf.tables import TABLES, choose_table_grid, pack_table, table_codes, table_dequantized
from llmq.gguf.tokenizer import write_tokenizer
from llmq.io.atomic import check_output_file, claim_output, partial_file
from llmq.io.checkpoint import Checkpoint
from llmq.progress import NO_PROGRESS, Progress

QUANTIZED_BY = "llmq"
SOURCE_KEY = "llmq.source_model"  # the checkpoint a file was written from (llmq.gguf.read)
_FLOAT = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    sources: tuple[str, ...]  # the checkpoint's names: one, or each expert's (stacked, in order)
    name: str  # the GGUF name
    shape: tuple[int, ...]  # [rows, cols]; stacked experts [experts, rows, cols]
    qtype: gguf.GGMLQuantizationType
    rotary_heads: int | None  # q/k rows to permute for the architecture's rotary layout
    offset: float = 0.0  # added to the stored values (Gemma's norms of 1 + weight)
    part: str | None = None  # the share of DeepSeek's kv_b it holds (llmq.gguf.mla)

    @property
    def nbytes(self) -> int:
        return type_bytes(self.qtype, self.shape)


def type_bytes(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """The bytes a tensor of `shape` takes stored as `qtype` (rows of whole blocks)."""
    if qtype in _FLOAT:
        return int(np.prod(shape)) * np.dtype(_FLOAT[qtype]).itemsize
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1])) * shape[-1] // block * size


@dataclass(slots=True)
class GGUFResult:
    out: str
    model: str
    scheme: str
    types: dict[str, int]  # tensors per GGUF type
    importance: str | None  # where the importance matrix came from, if any
    seconds: float
    size_bytes: dict[str, int]
    worst_tensors: list[dict[str, Any]] = field(default_factory=list)  # highest relative RMSE
    mixed_precision: dict[str, Any] | None = None  # the types chosen to a budget (llmq.gguf.budget)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_gguf(
    ckpt: Checkpoint,
    out: Path,
    scheme: GGUFScheme,
    *,
    overrides: tuple[tuple[str, gguf.GGMLQuantizationType], ...] = (),
    statistics: Statistics | None = None,
    importance_source: str | None = None,
    overwrite: bool = False,
    progress: Progress = NO_PROGRESS,
) -> GGUFResult:
    """Encode `ckpt` into the GGUF file `out` with `scheme`'s mix (and `overrides`, first
    match wins). `statistics` gives each weight's importance (the mean square of each of its
    inputs over calibration text, llama.cpp's importance matrix): the scale search weighs each
    weight's error by it; and its input Hessian, where GPTQ's error feedback chooses the codes
    on the searched grid (`gptq_codes`) instead of the nearest. None: plain rounding."""
    started = time.perf_counter()
    arch = gguf_arch(ckpt.config)
    config = ckpt.model_config()
    rope_of(config)  # refused before anything is written
    plan = plan_tensors(ckpt, scheme, overrides, has_imatrix=importance_source is not None)
    with claim_output(out, inputs=[("model", ckpt.path)]):
        check_gguf_output(out, overwrite=overwrite)
        with partial_file(out) as partial:
            writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[arch.arch])
            writer.add_name(ckpt.path.name)
            writer.add_quantized_by(QUANTIZED_BY)
            writer.add_string(SOURCE_KEY, str(ckpt.path.resolve()))  # for `llmq verify`
            write_hyperparameters(writer, config, arch)
            writer.add_file_type(scheme.file_type)
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            vocab_size = int(ckpt.config["vocab_size"])
            write_tokenizer(writer, ckpt.path, vocab_size, spaces_user_defined=arch.spaces_user_defined)  # fmt: skip
            errors = _write_tensors(writer, ckpt, plan, statistics or FixedStatistics(), progress)
    worst = sorted(errors.items(), key=lambda item: -item[1])[:5]
    return GGUFResult(
        out=str(out),
        model=str(ckpt.path),
        scheme=scheme.name,
        types=dict(Counter(t.qtype.name for t in plan)),
        importance=importance_source,
        seconds=time.perf_counter() - started,
        size_bytes={"source": _weights_bytes(ckpt), "output": out.stat().st_size},
        worst_tensors=[{"name": name, "relative_rmse": error} for name, error in worst],
    )


@dataclass(frozen=True, slots=True)
class NamedTensor:
    sources: tuple[str, ...]  # the checkpoint's names: one, each expert's (stacked, in order),
    # or none for a tensor llama.cpp needs that the checkpoint derives from its config
    name: str  # the GGUF name
    shape: tuple[int, ...]  # stacked experts: [experts, rows, cols]
    rotary_heads: int | None  # q/k rows to permute for the architecture's rotary layout
    offset: float = 0.0  # added to the stored values (Gemma's norms of 1 + weight)
    part: str | None = None  # the share of DeepSeek's kv_b it holds (llmq.gguf.mla)


def named_tensors(ckpt: Checkpoint) -> list[NamedTensor]:
    """Every tensor of the checkpoint with its GGUF name, in the checkpoint's order; a mixture's
    experts of one role (per layer) stacked in one tensor, as llama.cpp's converter writes them.
    A family whose norms compute (offset + weight) has the offset added to its norms' values, as
    llama.cpp multiplies by the stored weight (its converter's rule: names ending norm.weight)."""
    arch = gguf_arch(ckpt.config)
    names = TensorNames(arch, ckpt.num_layers)
    config = ckpt.config
    heads = int(config["num_attention_heads"])
    rotary = {"attn_q": heads, "attn_k": int(config.get("num_key_value_heads") or heads)}
    latent_parts = mla.part_shapes(ckpt.model_config()) if arch.arch == gguf.MODEL_ARCH.DEEPSEEK2 else {}  # fmt: skip
    grouped: dict[str, list[str]] = {}
    for source in ckpt.tensors:
        if not source.endswith("rotary_emb.inv_freq"):
            grouped.setdefault(names.gguf_name(source), []).append(source)
    named = []
    for name, sources in grouped.items():
        shape = tuple(ckpt.tensors[sources[0]].shape)
        if name.endswith(VECTORS):
            shape = shape[-1:]
        if len(sources) > 1:  # experts, by index
            sources.sort(key=lambda source: int(EXPERT_INDEX.search(source).group(1)))  # type: ignore[union-attr]
            shape = (len(sources), *shape)
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        heads_here = rotary.get(kind) if arch.permute_rotary and name.endswith(".weight") else None
        offset = ckpt.layout.norm_weight_offset if sources[0].endswith("norm.weight") else 0.0
        if latent_parts and name.endswith(mla.KV_B_SUFFIX):
            for part, part_shape in latent_parts.items():
                named.append(NamedTensor(tuple(sources), mla.part_name(name, part), part_shape, None, part=part))  # fmt: skip
            continue
        named.append(NamedTensor(tuple(sources), name, shape, heads_here, offset))
    for name, values in derived_tensors(ckpt).items():
        named.append(NamedTensor((), name, values.shape, None))
    return named


def derived_tensors(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """Tensors llama.cpp reads that a checkpoint states in its config, as llama.cpp's converter
    writes them: Llama 3.1's rotary factors (`rope_freqs`), Phi-3's longrope factors for long and
    short contexts (`rope_factors_long`, `rope_factors_short`)."""
    config = ckpt.model_config()
    scaling = rope_of(config).scaling or {}
    name = gguf.TENSOR_NAMES
    if scaling.get("rope_type") == "llama3":
        return {name[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight": llama3_rope_factors(config)}
    if scaling.get("rope_type") == "longrope":
        return {
            name[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight": np.asarray(scaling["long_factor"], np.float32),
            name[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight": np.asarray(scaling["short_factor"], np.float32),
        }  # fmt: skip
    return {}


def plan_tensors(
    ckpt: Checkpoint,
    scheme: GGUFScheme,
    overrides: tuple[tuple[str, Any], ...] = (),
    *,
    has_imatrix: bool = True,
) -> list[PlannedTensor]:
    """Every tensor of the checkpoint with its GGUF name and type: the tensors outside the
    decoder layers first, then layer by layer, each layer's in the checkpoint's order."""
    output = "token_embd.weight" if ckpt.tied_embeddings else "output.weight"
    layers = ckpt.num_layers
    heads = int(ckpt.config.get("num_attention_heads") or 1)
    shared_kv = heads // int(ckpt.config.get("num_key_value_heads") or heads)
    plan = []
    for t in named_tensors(ckpt):
        is_output = t.name == output
        qtype = choose_type(
            scheme, t.name, t.shape, layers, is_output=is_output, overrides=overrides,
            shared_kv=shared_kv, has_imatrix=has_imatrix,
        )  # fmt: skip
        plan.append(PlannedTensor(t.sources, t.name, t.shape, qtype, t.rotary_heads, t.offset, t.part))  # fmt: skip
    return sorted(plan, key=lambda t: gguf_layer(t.name))  # layer by layer (a streamed calibration)


def _write_tensors(
    writer: gguf.GGUFWriter,
    ckpt: Checkpoint,
    plan: list[PlannedTensor],
    statistics: Statistics,
    progress: Progress,
) -> dict[str, float]:
    """Declare every tensor, write the header, then encode and write them one at a time.
    Returns each quantized tensor's relative RMSE."""
    for tensor in plan:
        dtype = _FLOAT.get(tensor.qtype, np.uint8)
        shape = tensor.shape if tensor.qtype in _FLOAT else _byte_shape(tensor)
        raw = None if tensor.qtype in _FLOAT else tensor.qtype
        writer.add_tensor_info(tensor.name, shape, np.dtype(dtype), tensor.nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    errors = {}
    derived = derived_tensors(ckpt)
    config = ckpt.model_config()
    with progress.stage("encoding and writing tensors", total=len(plan)) as step:
        for tensor in plan:
            if not tensor.sources:
                writer.write_tensor_data(derived[tensor.name])
                step(1)
                continue
            parts, part_errors = [], []
            for expert, source in enumerate(tensor.sources):  # one at a time: stacked experts
                shape = tensor.shape[1:] if len(tensor.sources) > 1 else tensor.shape
                weight = ckpt.read(source).float().numpy()
                weight = weight if tensor.part else weight.reshape(shape)
                ckpt.close()
                if tensor.rotary_heads is not None:
                    weight = permute_rotary_rows(weight, tensor.rotary_heads)
                weight = weight + tensor.offset if tensor.offset else weight
                weights_importance = statistics.importance(tensor.name)
                hessian = statistics.hessian(source)
                if (
                    tensor.part is not None
                ):  # a share of kv_b, reshaped: kv_b's Hessian does not fit
                    weight = mla.split_kv_b(weight, tensor.part, config).reshape(
                        -1, tensor.shape[-1]
                    )
                    weights_importance, hessian = None, None
                if weights_importance is not None and weights_importance.ndim == 2:  # per expert
                    weights_importance = weights_importance[expert]
                data, error = encode(tensor, weight, weights_importance, hessian)
                parts.append(data)
                part_errors.append(error)
            if part_errors[0] is not None:
                errors[tensor.name] = max(
                    e for e in part_errors if e is not None
                )  # the worst expert's
            writer.write_tensor_data(parts[0] if len(parts) == 1 else np.concatenate(parts))
            step(1)
    writer.close()
    return errors


def encode(
    tensor: PlannedTensor,
    weight: np.ndarray,
    importance: np.ndarray | None,
    hessian: Tensor | None = None,
) -> tuple[np.ndarray, float | None]:
    """The tensor's bytes as its type stores them, and (quantized types) the relative RMSE of
    what a reader decodes."""
    if tensor.qtype in _FLOAT:
        return np.ascontiguousarray(weight.astype(_FLOAT[tensor.qtype])), None
    decoded, data = quantized(tensor.qtype, weight, importance, hessian)
    norm = float(np.linalg.norm(weight))
    error = float(np.linalg.norm(decoded - weight)) / norm if norm > 0 else 0.0
    return data, error


def quantized(
    qtype: gguf.GGMLQuantizationType,
    weight: np.ndarray,
    importance: np.ndarray | None,
    hessian: Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`weight` [rows, cols] as quantized type `qtype` stores it: what a reader decodes, and the
    bytes. The scale search weighs each input by `importance`; `hessian`: GPTQ's codes."""
    if qtype in TABLES:  # no GPTQ on a table's indices (refused before the pass)
        table_grid = choose_table_grid(qtype, weight, importance)
        codes = table_codes(table_grid, weight)
        return table_dequantized(table_grid, codes), pack_table(table_grid, codes)
    grid = choose_grid(qtype, weight, importance)
    codes = codes_for(grid, weight) if hessian is None else gptq_codes(grid, weight, hessian)
    return dequantized(grid, codes), pack(grid, codes)


def _byte_shape(tensor: PlannedTensor) -> tuple[int, ...]:
    block, size = GGML_QUANT_SIZES[tensor.qtype]
    return (*tensor.shape[:-1], tensor.shape[-1] // block * size)


def _weights_bytes(ckpt: Checkpoint) -> int:
    return sum(path.stat().st_size for path in ckpt.path.glob("*.safetensors"))


def check_gguf_output(out: Path, *, overwrite: bool) -> None:
    """Refuse an existing OUT without `overwrite`, and with it any file llmq did not write."""
    check_output_file(out, overwrite=overwrite, ours=written_by_llmq, kind="a GGUF file")


def written_by_llmq(path: Path) -> bool:
    return read_field(path, gguf.Keys.General.QUANTIZED_BY) == QUANTIZED_BY
