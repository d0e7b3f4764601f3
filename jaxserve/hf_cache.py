"""Model references -> local directories: a path, or a Hugging Face model id (``org/name``) found
in the local Hugging Face cache, read offline as vLLM reads it with ``HF_HUB_OFFLINE=1``.

jaxserve downloads nothing. ``EngineConfig.model_dir`` (and ``tokenizer_dir``) ask
``resolve_model_dir``; ``jaxserve serve`` asks it before anything loads, so a model that is not
there ends the start in one line that says how to get it.

The cache's layout (``huggingface_hub``'s): ``<cache>/models--org--name/refs/<branch>`` holds a
commit hash, and ``<cache>/models--org--name/snapshots/<commit>/`` the files of that revision
(links into ``blobs/``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# huggingface_hub's rule for a repository id: one or two names of letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"^[\w.-]{1,96}(/[\w.-]{1,96})?$")


class ModelNotFoundError(ValueError):
    """A model that is neither a local directory nor in the Hugging Face cache."""


def hf_hub_cache_dir() -> Path:
    """Where ``huggingface_hub`` keeps downloaded models, from the same variables in the same
    order: ``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE`` (older), ``$HF_HOME/hub``,
    ``$XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub``."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home).expanduser() / "huggingface" / "hub"


def is_repo_id(model: str) -> bool:
    """Whether ``model`` could name a Hugging Face model (``org/name`` or ``name``)."""
    if not _REPO_ID.match(model) or ".." in model or "--" in model:
        return False
    return not any(part[0] in ".-" or part[-1] in ".-" for part in model.split("/"))


def resolve_model_dir(
    model: str, revision: str | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The directory ``model`` names: itself when it exists, else the cached snapshot of the
    Hugging Face model of that id at ``revision`` (a branch, tag or commit; default ``main``),
    looked up in ``cache_dir`` (default: ``hf_hub_cache_dir()``). Raises ModelNotFoundError,
    whose message says how to download the model, when neither is there."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not is_repo_id(model):
        raise ModelNotFoundError(f"{model}: no such model directory")
    cache = Path(cache_dir).expanduser() if cache_dir else hf_hub_cache_dir()
    repo = cache / f"models--{model.replace('/', '--')}"
    wanted = revision or "main"
    if not (repo / "snapshots").is_dir():
        raise ModelNotFoundError(
            f"{model} is not a local directory, and no Hugging Face model of that id is in "
            f"the cache ({cache}); jaxserve downloads nothing: get it with "
            f"`hf download {model}` (or `huggingface-cli download {model}`), which puts it in "
            f"that cache, then run again, or pass the model's directory"
        )
    ref = repo / "refs" / wanted
    commit = ref.read_text().strip() if ref.is_file() else wanted
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        cached = ", ".join(sorted(p.name for p in (repo / "snapshots").iterdir())) or "none"
        raise ModelNotFoundError(
            f"{model}: revision {wanted!r} is not in the Hugging Face cache ({repo}; cached "
            f"snapshots: {cached}); get it with `hf download {model} --revision {wanted}`, or "
            "pick a cached one with --revision"
        )
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(
            f"{model}: the cached snapshot {snapshot} has no config.json (an interrupted "
            f"download?); run `hf download {model}` again"
        )
    return snapshot
