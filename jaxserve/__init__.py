"""jaxserve: an LLM serving engine in JAX.

import jaxserve
llm = jaxserve.LLM("path/to/model")
outputs = llm.generate(["Hello"], jaxserve.SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxserve.engine.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "PoolingParams": "jaxserve.pooling_params",
    "EmbeddingRequestOutput": "jaxserve.engine.outputs",
    "ScoringRequestOutput": "jaxserve.engine.outputs",
    "ClassificationRequestOutput": "jaxserve.engine.outputs",
    "RequestOutput": "jaxserve.engine.outputs",
    "CompletionOutput": "jaxserve.engine.outputs",
    "Logprob": "jaxserve.engine.outputs",
    "EngineConfig": "jaxserve.engine_config",
    "ModelConfig": "jaxserve.config",
    "LoRARequest": "jaxserve.lora_request",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:  # imported lazily: `import jaxserve` stays cheap
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
