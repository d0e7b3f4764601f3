"""Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm): the Llama decoder's tables."""

from __future__ import annotations

from jaxserve.models.families.family import Family
from jaxserve.models.families.llama import LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS

FAMILIES = (
    Family("qwen2", ("Qwen2ForCausalLM",), LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    Family("qwen3", ("Qwen3ForCausalLM",), LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
)
