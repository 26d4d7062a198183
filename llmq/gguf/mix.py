"""Which GGUF type each tensor gets: a scheme's mix, as llama.cpp's quantizer chooses it, and
the user's `--tensor-type PATTERN=TYPE` overrides.

llama.cpp names its file types after their main type and a size: `_S` keeps the main type
almost everywhere, `_M` spends more bits where the error costs most. The rules here are the
ones its `llama-quantize` applies to dense decoders (docs/gguf.md lists them):

- the output projection (the tied embedding when there is none) at Q6_K under any K-quant
  scheme, Q8_0 under q8_0;
- q4_k_m and q5_k_m: attn_v and ffn_down at Q6_K in the first and last eighth of the layers and
  every third layer in between (`_more_bits`);
- q4_k_s: attn_v at Q5_K in the first four layers, ffn_down at Q5_K in the first eighth;
- norms and other 1-D tensors stay F32;
- mxfp4_moe: a mixture's experts at MXFP4, everything else at Q8_0 (GPT-OSS's release format);
- iq4_xs: attn_v at Q5_K where 4 or more query heads share a key head, ffn_down at Q5_K in the
  first eighth of the layers when no importance matrix is given;
- a K-quant needs rows of whole 256-weight super-blocks: a tensor whose rows are not falls back
  to the nearest 32-block type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL), and
  to F16 when its rows are not whole 32-blocks either.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from llmq.errors import InputError
from llmq.gguf.blocks import SPECS
from llmq.gguf.model import gguf_layer
from llmq.gguf.tables import TABLES

_Q = GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class GGUFScheme:
    """A llama.cpp file type: its main tensor type and how it raises some tensors."""

    name: str
    main: GGMLQuantizationType
    file_type: LlamaFileType
    more_bits: GGMLQuantizationType | None = None  # attn_v / ffn_down in `_more_bits` layers
    early_bits: GGMLQuantizationType | None = None  # q4_k_s's raised early layers
    shared_v_bits: GGMLQuantizationType | None = None  # attn_v where 4+ query heads share it
    plain_down_bits: GGMLQuantizationType | None = None  # early ffn_down without an imatrix
    expert_bits: GGMLQuantizationType | None = None  # a mixture's stacked experts


SCHEMES = {
    scheme.name: scheme
    for scheme in (
        GGUFScheme("q4_k_m", _Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M, more_bits=_Q.Q6_K),
        GGUFScheme("q4_k_s", _Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_S, early_bits=_Q.Q5_K),
        GGUFScheme("q5_k_m", _Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M, more_bits=_Q.Q6_K),
        GGUFScheme("q5_k_s", _Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
        GGUFScheme("q6_k", _Q.Q6_K, LlamaFileType.MOSTLY_Q6_K),
        GGUFScheme("q8_0", _Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
        GGUFScheme("q4_0", _Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
        GGUFScheme("mxfp4_moe", _Q.Q8_0, LlamaFileType.MOSTLY_MXFP4_MOE, expert_bits=_Q.MXFP4),
        GGUFScheme(
            "iq4_xs",
            _Q.IQ4_XS,
            LlamaFileType.MOSTLY_IQ4_XS,
            shared_v_bits=_Q.Q5_K,
            plain_down_bits=_Q.Q5_K,
        ),
    )
}
K_FALLBACK = {_Q.Q4_K: _Q.Q5_0, _Q.Q5_K: _Q.Q5_1, _Q.Q6_K: _Q.Q8_0, _Q.IQ4_XS: _Q.IQ4_NL}
# The types llmq writes: the uniform grids (llmq.gguf.blocks) and the table types (tables)
QUANTIZED_TYPES = (*SPECS, *TABLES)
FLOAT_TYPES = {"f32": _Q.F32, "f16": _Q.F16}


def get_gguf_scheme(name: str) -> GGUFScheme:
    try:
        return SCHEMES[name.lower()]
    except KeyError:
        raise InputError(
            f"--scheme {name}: not a GGUF scheme", hint=f"choose one of {', '.join(SCHEMES)}"
        ) from None


def parse_tensor_types(rules: tuple[str, ...]) -> tuple[tuple[str, GGMLQuantizationType], ...]:
    """`PATTERN=TYPE` rules (a glob over GGUF tensor names, e.g. "blk.*.ffn_down.weight=q6_k"),
    in the order given: the first that matches a tensor wins."""
    parsed = []
    for rule in rules:
        pattern, sep, type_name = rule.partition("=")
        if not sep or not pattern:
            raise InputError(f"--tensor-type {rule!r}: expected PATTERN=TYPE")
        parsed.append((pattern, tensor_type(type_name)))
    return tuple(parsed)


def tensor_type(name: str) -> GGMLQuantizationType:
    """A GGUF type llmq writes, by name (q4_k, Q6_K, f16, ...)."""
    key = name.strip().lower()
    if key in FLOAT_TYPES:
        return FLOAT_TYPES[key]
    for qtype in QUANTIZED_TYPES:
        if qtype.name.lower() == key:
            return qtype
    known = ", ".join([*FLOAT_TYPES, *(q.name.lower() for q in QUANTIZED_TYPES)])
    raise InputError(f"GGUF type {name!r}: not one llmq writes", hint=f"choose one of {known}")


def choose_type(
    scheme: GGUFScheme,
    name: str,
    shape: tuple[int, ...],
    num_layers: int,
    *,
    is_output: bool,
    overrides: tuple[tuple[str, GGMLQuantizationType], ...] = (),
    shared_kv: int = 1,
    has_imatrix: bool = True,
) -> GGMLQuantizationType:
    """The type of GGUF tensor `name` [rows, cols] (gguf's names) under `scheme`, for a model
    whose key heads each serve `shared_kv` query heads. Routers (`ffn_gate_inp`, a shared
    expert's gate too) stay F32 whatever is asked, as llama.cpp's quantizer keeps them: a
    rounded router picks other experts."""
    if len(shape) < 2 or name.endswith(".bias") or ".ffn_gate_inp" in name:  # stacked biases 2-D
        return _Q.F32
    wanted = next((t for pattern, t in overrides if fnmatch.fnmatchcase(name, pattern)), None)
    if wanted is None:
        wanted = _scheme_type(scheme, name, num_layers, is_output, shared_kv, has_imatrix)
    return fitting_type(wanted, shape[-1])


def _scheme_type(scheme: GGUFScheme, name: str, num_layers: int, is_output: bool, shared_kv: int, has_imatrix: bool) -> GGMLQuantizationType:  # fmt: skip
    if is_output:
        return _Q.Q8_0 if scheme.main == _Q.Q8_0 else _Q.Q6_K if scheme.main in K_FALLBACK else scheme.main  # fmt: skip
    if scheme.expert_bits is not None and "_exps." in name:
        return scheme.expert_bits
    index = gguf_layer(name)
    if index < 0:
        return scheme.main
    if scheme.shared_v_bits is not None and ".attn_v." in name and shared_kv >= 4:
        return scheme.shared_v_bits
    early = index < num_layers // 8
    if scheme.plain_down_bits is not None and ".ffn_down" in name and early and not has_imatrix:
        return scheme.plain_down_bits
    # llama.cpp matches "ffn_down" anywhere in the name: a mixture's stacked ffn_down_exps too
    ffn_down = ".ffn_down." in name or ".ffn_down_exps." in name
    raised = ".attn_v." in name or ffn_down
    if raised and scheme.more_bits is not None and _more_bits(index, num_layers):
        return scheme.more_bits
    if scheme.early_bits is not None:
        if ".attn_v." in name and index < 4:
            return scheme.early_bits
        if ffn_down and index < num_layers // 8:
            return scheme.early_bits
    return scheme.main


def _more_bits(index: int, num_layers: int) -> bool:
    """llama.cpp's layers that `_M` schemes raise: the first and last eighth, and every third
    layer in between."""
    eighth = num_layers // 8
    return index < eighth or index >= 7 * num_layers // 8 or (index - eighth) % 3 == 2


def fitting_type(wanted: GGMLQuantizationType, cols: int) -> GGMLQuantizationType:
    """`wanted`, or what llama.cpp falls back to when a row is not whole blocks of it."""
    if wanted in FLOAT_TYPES.values():
        return wanted
    if cols % GGML_QUANT_SIZES[wanted][0] == 0:
        return wanted
    fallback = K_FALLBACK.get(wanted)
    if fallback is not None and cols % GGML_QUANT_SIZES[fallback][0] == 0:
        return fallback
    return _Q.F16
