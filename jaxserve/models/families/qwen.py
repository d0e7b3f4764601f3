"""Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm): the Llama decoder's tables."""

from __future__ import annotations

from jaxserve.config import ConfigFeatures
from jaxserve.config_fields import ConfigFields
from jaxserve.models.families.family import Family
from jaxserve.models.families.llama import LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS


def _always(hf: ConfigFields) -> bool:
    return True


# Qwen's configs carry a sliding_window that counts only with use_sliding_window.
QWEN2 = ConfigFeatures(attention_bias=_always, sliding_window_opt_in=True)
QWEN3 = ConfigFeatures(qk_norm=True, sliding_window_opt_in=True)

# The base models (``*Model``, no head) are what embedding checkpoints name: --runner pooling.
FAMILIES = (
    Family(
        "qwen2", ("Qwen2ForCausalLM", "Qwen2Model"), LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS, QWEN2
    ),
    Family(
        "qwen3", ("Qwen3ForCausalLM", "Qwen3Model"), LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS, QWEN3
    ),
)
