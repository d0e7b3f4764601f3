"""How a model's hidden states become one embedding: ``PoolingConfig``, read from the model's
directory as sentence-transformers writes it, and the host's last step (pick, truncate,
normalize). Plain Python and numpy: the server and the engine read it without JAX.

Where it comes from: ``modules.json`` names the modules; its Pooling module's
``config.json`` (``1_Pooling/config.json``) gives the pooling (``pooling_mode``: ``lasttoken``,
``mean`` or ``cls``, as sentence-transformers 6 writes it, or the older booleans
``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``), and a
Normalize module means unit-length embeddings. Without ``modules.json``: last-token pooling,
normalized, vLLM's default for a decoder. ``config.json``'s ``matryoshka_dimensions`` (or
``is_matryoshka``) say which ``dimensions`` a request may ask for, as vLLM reads them.

Where it goes: ``EngineCore`` reads it at start-up (``--runner pooling``), checks each request's
``PoolingParams`` against it (``check``) and, once a request's last prompt chunk has run, turns
what the runner returned for its chunks (``runner/programs.pool_step``: per chunk the sum of the
hidden states, the first and the last token's) into the embedding (``embedding``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParamsError

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' names of the pooling modes served, new (``pooling_mode``) and old.
_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_MODE_FLAGS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSERVED_FLAGS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


class PoolingConfigError(ValueError):
    """A sentence-transformers configuration the engine cannot serve (names the file)."""


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # the default when a request leaves ``normalize`` unset
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: any up to hidden_size
    source: str = "defaults"  # where it was read, for the start-up log

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, hidden_size: int, default_type: str = "last"
    ) -> PoolingConfig:
        """``default_type``: the pooling without ``modules.json`` (a decoder's last token, an
        encoder's CLS), normalized."""
        model_dir = Path(model_dir)
        pooling_type, normalize, source = default_type, True, "defaults (no modules.json)"
        modules_path = model_dir / "modules.json"
        if modules_path.is_file():
            pooling_type, normalize = _read_modules(model_dir, modules_path, default_type)
            source = str(modules_path)
        raw = _read_json(model_dir / "config.json")
        dims = raw.get("matryoshka_dimensions")
        if dims is not None and (
            not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims)
        ):
            raise PoolingConfigError(
                f"{model_dir / 'config.json'}: matryoshka_dimensions={dims!r} must be a list "
                "of positive integers"
            )
        return cls(
            pooling_type,
            normalize,
            hidden_size,
            is_matryoshka=bool(raw.get("is_matryoshka")) or dims is not None,
            matryoshka_dimensions=tuple(dims) if dims is not None else None,
            source=source,
        )

    @property
    def uses_every_token(self) -> bool:
        """Every prompt token's hidden state counts (mean, CLS): a prompt's blocks cannot be
        taken from the prefix cache, whose tokens are not computed again."""
        return self.pooling_type != "last"

    def describe(self) -> str:
        dims = ""
        if self.is_matryoshka:
            listed = self.matryoshka_dimensions
            dims = f", Matryoshka dimensions {list(listed) if listed else 'any'}"
        norm = "normalized" if self.normalize else "not normalized"
        return f"{self.pooling_type} pooling, {norm}{dims} (from {self.source})"

    def check(self, params: PoolingParams) -> None:
        """``SamplingParamsError`` naming ``dimensions`` when this model cannot give them."""
        dims = params.dimensions
        if dims is None:
            return
        if not self.is_matryoshka:
            raise SamplingParamsError(
                "dimensions",
                "dimensions: this model does not support matryoshka representation "
                "(config.json lists no matryoshka_dimensions); leave dimensions unset",
            )
        listed = self.matryoshka_dimensions
        if listed is not None and dims not in listed:
            raise SamplingParamsError(
                "dimensions",
                f"dimensions={dims} is not one of this model's matryoshka dimensions "
                f"{list(listed)}",
            )
        if dims > self.hidden_size:
            raise SamplingParamsError(
                "dimensions",
                f"dimensions={dims} is more than the model's hidden size {self.hidden_size}",
            )

    def embedding(
        self,
        sum_hidden: np.ndarray,  # f32[H]  the prompt's hidden states, summed
        first: np.ndarray,  # f32[H]  the first prompt token's
        last: np.ndarray,  # f32[H]  the last prompt token's
        num_tokens: int,
        params: PoolingParams,
    ) -> np.ndarray:  # f32[dimensions or H]
        """The embedding: pooled, truncated to ``params.dimensions``, then normalized (as
        ``params.normalize`` says, else as the model does)."""
        if self.pooling_type == "mean":
            pooled = sum_hidden / max(num_tokens, 1)
        else:
            pooled = first if self.pooling_type == "cls" else last
        pooled = np.asarray(pooled, np.float32)
        if params.dimensions is not None:
            pooled = pooled[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            # sentence-transformers' Normalize: torch's F.normalize, eps 1e-12
            pooled = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
        return pooled.astype(np.float32)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PoolingConfigError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(raw, dict | list):
        raise PoolingConfigError(f"{path}: not a JSON object")
    return raw  # type: ignore[return-value]


def _read_modules(
    model_dir: Path, modules_path: Path, default_type: str = "last"
) -> tuple[str, bool]:
    """(pooling type, normalize) of a sentence-transformers ``modules.json`` (a cross-encoder's
    names no Pooling module: ``default_type``)."""
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise PoolingConfigError(f"{modules_path}: a list of modules is expected")
    pooling_type, normalize = default_type, False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            path = model_dir / str(module.get("path", "")) / "config.json"
            pooling_type = _pooling_mode(path, _read_json(path))
    return pooling_type, normalize


def _pooling_mode(path: Path, raw: dict[str, Any]) -> str:
    """The pooling of a sentence-transformers Pooling ``config.json`` (new or old keys)."""
    mode = raw.get("pooling_mode")
    if isinstance(mode, str):
        if mode not in _MODE_NAMES:
            raise PoolingConfigError(
                f"{path}: pooling_mode={mode!r} is not served; one of {', '.join(_MODE_NAMES)} is"
            )
        return _MODE_NAMES[mode]
    chosen = [kind for flag, kind in _MODE_FLAGS.items() if raw.get(flag)]
    unserved = [flag for flag in _UNSERVED_FLAGS if raw.get(flag)]
    if unserved or len(chosen) != 1:
        raise PoolingConfigError(
            f"{path}: exactly one of {', '.join(_MODE_FLAGS)} must be true (got "
            f"{', '.join(chosen + unserved) or 'none'})"
        )
    return chosen[0]


def is_base_model(architectures: list[str]) -> bool:
    """config.json names only base models (``Qwen3Model``, ``MistralModel``): a checkpoint
    with no language-model head, published for embeddings (``--runner auto`` pools it)."""
    return bool(architectures) and all(
        a.endswith("Model") and not a.endswith("LMHeadModel") for a in architectures
    )
