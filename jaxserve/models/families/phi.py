"""Phi-3: the Llama decoder with q, k and v in one checkpoint tensor, gate and up in another
(split as they load), and the longrope scaling (once spelled ``su``)."""

from __future__ import annotations

import dataclasses

from jaxserve.models.families.family import Family
from jaxserve.models.families.llama import LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS

# Phi-3: q, k and v in one qkv_proj tensor, gate and up in one gate_up_proj.
_QKV = ("ND", "KD", "KD")
_GATE_UP = ("I", "I")
_PHI3_FUSED = {
    "wq": ("self_attn.qkv_proj.weight", _QKV, 0),
    "wk": ("self_attn.qkv_proj.weight", _QKV, 1),
    "wv": ("self_attn.qkv_proj.weight", _QKV, 2),
    "w_gate": ("mlp.gate_up_proj.weight", _GATE_UP, 0),
    "w_up": ("mlp.gate_up_proj.weight", _GATE_UP, 1),
}
PHI3_LAYER_FIELDS = tuple(
    dataclasses.replace(
        field,
        hf_name=_PHI3_FUSED[field.name][0],
        fused=_PHI3_FUSED[field.name][1],
        part=_PHI3_FUSED[field.name][2],
    )
    if field.name in _PHI3_FUSED
    else field
    for field in LLAMA_LAYER_FIELDS
    if field.name not in ("bq", "bk", "bv", "q_norm", "k_norm")
)

FAMILIES = (Family("phi3", ("Phi3ForCausalLM",), PHI3_LAYER_FIELDS, LLAMA_MODEL_FIELDS),)
