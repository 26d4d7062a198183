"""GPT-OSS's fused experts, read as per-expert linears and written back fused.

GPT-OSS stores a layer's experts as transformers holds them (`Experts.fused_gate_up`):
gate_up_proj [E, hidden, 2 x intermediate] with gate in the even columns and up in the odd
ones, down_proj [E, intermediate, hidden], each with a `_bias` [E, columns]. Its hub releases
store the two weights MXFP4 instead: `_blocks` uint8 [E, columns, in / 32, 16] (two E2M1 codes a
byte, the even one in the low nibble) and `_scales` uint8 [E, columns, in / 32] (E8M0 exponent
bytes), a row per output feature: byte for byte compressed-tensors' mxfp4-pack-quantized
`weight_packed` and `weight_scale`, once split per expert.

Every llmq method works on per-expert linears (calib/experts.py), so the checkpoint shows each
expert's linear under its own name (`mlp.experts.3.gate_proj.weight`, `.bias`; from an MXFP4
release `.weight_packed` and `.weight_scale`, which llmq's readers take for an mxfp4a16 linear),
each read as a slice of the fused tensor. A written layer's per-expert tensors are fused back
into the checkpoint's own form, which transformers and vLLM read as GPT-OSS.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmq.errors import InputError
from llmq.io.layout import DecoderLayout
from llmq.io.views import ShownTensors, StoredReader

if TYPE_CHECKING:  # torch is imported where tensors are read or written: `--help` needs none
    from torch import Tensor

    from llmq.io.checkpoint import TensorInfo

ROLES = ("gate", "up", "down")
MXFP4_GROUP = 32
_BLOCKS, _SCALES, _BIAS = "_blocks", "_scales", "_bias"
# the written tensors of an expert's MXFP4 linear (llmq's mxfp4-pack-quantized), and of a dense one
_PACKED, _SCALE, _SHAPE, _WEIGHT = "weight_packed", "weight_scale", "weight_shape", "weight"


@dataclass(frozen=True, slots=True)
class ExpertSlice:
    """Where one of an expert's tensors lives in a layer's fused ones: expert `expert` of
    `stored`, the rows (output features) of `role` (gate: the even ones of gate_up, up: the
    odd ones, down: all of down's)."""

    stored: str  # a fused tensor's name: the weight, its bias, its _blocks or _scales
    expert: int
    role: str

    def read(self, stored: StoredReader) -> Tensor:
        """The expert's tensor [out, ...], its own entry of the fused one read alone."""
        tensor = stored(self.stored, self.expert)
        rows = {"gate": slice(0, None, 2), "up": slice(1, None, 2)}.get(self.role, slice(None))
        if self.stored.endswith(_BLOCKS):  # [out, in / 32, 16] -> weight_packed [out, in / 2]
            return tensor[rows].flatten(1).contiguous()
        if self.stored.endswith((_SCALES, _BIAS)):
            return tensor[rows].contiguous()
        return tensor[:, rows].T.contiguous()  # a float weight, stored [in, out]


def show_per_expert(tensors: ShownTensors, layout: DecoderLayout, num_layers: int) -> None:
    """Show each layer's fused experts as per-expert linears' tensors (in place)."""
    experts = layout.experts
    if experts is None or not experts.stored_fused:
        return
    shown, slices = tensors.shown, {}
    for index in range(num_layers):
        if layout.at(index).experts is None:
            continue
        base = f"{layout.layer_prefix(index)}{experts.module}."
        for role in ROLES:
            fused = base + str(experts.fused_down if role == "down" else experts.fused_gate_up)
            for leaf, (stored, shape) in _leaves(shown, fused, role == "down").items():
                for e in range(stored.shape[0]):
                    name = f"{base}{e}.{getattr(experts, role)}.{leaf}"
                    shown[name] = dataclasses.replace(stored, shape=shape)
                    slices[name] = ExpertSlice(_stored_name(fused, leaf), e, role)
    tensors.hide({where.stored for where in slices.values()})
    tensors.views.update(slices)


_STORED_AS = {_WEIGHT: "", _PACKED: _BLOCKS, _SCALE: _SCALES, "bias": _BIAS}


def _stored_name(fused: str, leaf: str) -> str:
    """The fused tensor a per-expert linear's `leaf` (weight, bias, ...) is stored in."""
    return fused + _STORED_AS[leaf]


def _leaves(
    tensors: dict[str, TensorInfo], fused: str, whole: bool
) -> dict[str, tuple[TensorInfo, tuple[int, ...]]]:
    """Per linear leaf of one fused tensor: its stored entry and one expert's share's shape
    (`whole`: the expert's linear has all the rows, else half: gate or up)."""

    def rows(count: int) -> int:
        return count if whole else count // 2

    leaves = {}
    if fused in tensors:  # [E, in, out]
        info = tensors[fused]
        leaves[_WEIGHT] = (info, (rows(info.shape[2]), info.shape[1]))
    elif fused + _BLOCKS in tensors and fused + _SCALES in tensors:  # [E, out, in / 32, 16]
        blocks, scales = tensors[fused + _BLOCKS], tensors[fused + _SCALES]
        leaves[_PACKED] = (blocks, (rows(blocks.shape[1]), blocks.shape[2] * blocks.shape[3]))
        leaves[_SCALE] = (scales, (rows(scales.shape[1]), scales.shape[2]))
    else:
        raise InputError(f"fused experts {fused!r} (or its MXFP4 _blocks and _scales) are missing")
    if fused + _BIAS in tensors:
        bias = tensors[fused + _BIAS]
        leaves["bias"] = (bias, (rows(bias.shape[1]),))
    return leaves


def fuse_experts(
    tensors: dict[str, Tensor], layout: DecoderLayout, prefix: str
) -> dict[str, Tensor]:
    """A written layer's tensors (names under `prefix`) with its per-expert tensors fused back
    as the checkpoint stores them; other families' tensors as they are."""
    experts = layout.experts
    if experts is None or not experts.stored_fused:
        return tensors
    base = f"{prefix}{experts.module}."
    out = {name: tensor for name, tensor in tensors.items() if not name.startswith(base)}
    mine = {name[len(base) :]: tensor for name, tensor in tensors.items() if name.startswith(base)}
    count = 1 + max(int(name.split(".")[0]) for name in mine)
    for fused, roles in ((experts.fused_gate_up, ("gate", "up")), (experts.fused_down, ("down",))):
        names = [[f"{e}.{getattr(experts, role)}" for role in roles] for e in range(count)]
        out.update({f"{base}{fused}{k}": v for k, v in _fused(mine, names).items()})
    if mine:
        raise ValueError(f"expert tensors left unfused: {sorted(mine)[:3]}")
    return out


def _fused(tensors: dict[str, Tensor], names: list[list[str]]) -> dict[str, Tensor]:
    """One fused tensor's stored parts (suffix -> tensor) from its experts' linears (`names`:
    per expert, the linears whose rows it interleaves), taken out of `tensors`."""
    import torch

    out: dict[str, Tensor] = {}
    for leaf in (_WEIGHT, _PACKED, _SCALE, "bias", _SHAPE):
        if f"{names[0][0]}.{leaf}" not in tensors:
            continue
        parts = torch.stack(
            [_interleave([tensors.pop(f"{name}.{leaf}") for name in linears]) for linears in names]
        )
        if leaf == _WEIGHT:  # [E, in, out], as transformers holds it
            parts = parts.transpose(1, 2).contiguous()
        elif leaf == _PACKED:  # [E, out, in / 32, 16]
            parts = parts.unflatten(-1, (-1, MXFP4_GROUP // 2))
        if leaf != _SHAPE:  # the fused tensor's shape is its own
            out[_STORED_AS[leaf]] = parts
    return out


def _interleave(parts: list[Tensor]) -> Tensor:
    """Rows of `parts` alternating (gate 0, up 0, gate 1, ...); one part as it is."""
    import torch

    if len(parts) == 1:
        return parts[0]
    return torch.stack(parts, dim=1).flatten(0, 1)


def mxfp4_release_config(layout: DecoderLayout) -> dict[str, Any]:
    """config.json's quantization_config of a GPT-OSS checkpoint whose experts are MXFP4, as its
    hub releases write it: everything but the experts kept in 16 bits."""
    experts = layout.experts
    assert experts is not None
    return {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            f"{layout.layers}.*.{layout.attention}",
            f"{layout.layers}.*.{experts.router}",
            layout.embed,
            layout.lm_head,
        ],
    }
