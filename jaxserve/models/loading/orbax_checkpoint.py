"""A converted checkpoint: the served ``Weights`` (cast, fused, quantized) saved with
orbax-checkpoint, beside what a start needs to serve the directory alone.

``jaxserve convert`` (``runner/convert.py``) loads a model as it is served and writes, into one
directory: the weights with orbax (``weights/``), the model's config.json, generation_config.json,
tokenizer and chat-template files (copied), and ``jaxserve_checkpoint.json``, the manifest: the
jaxserve version, the dtype, the quantization, whether q/k/v and gate/up are fused, the fp8
KV cache's scales, and every leaf of the pytree (path, shape, dtype). The manifest is written
last, so a directory holding it holds a whole checkpoint.

A start (``runner/model_weights.py``) or a weight update finds the manifest
(``is_converted_checkpoint``), checks it against what it serves (``check_served_as``) and
``restore_weights`` restores each leaf into the target's sharding: orbax reads on each device
(on each host) only the shards that device holds. orbax is imported only here, when a
checkpoint is written or read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxserve.models.loading.checkpoint_reader import WeightsError

MANIFEST_NAME = "jaxserve_checkpoint.json"
WEIGHTS_DIR = "weights"  # the orbax checkpoint, inside the converted directory
FORMAT_VERSION = 1
# Files of the source model not copied: its weights in any format (the converted ones replace
# them) and their indexes.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".npz")


@contextlib.contextmanager
def _orbax_quiet() -> Iterator[None]:
    """orbax's INFO lines (a dozen per save or restore, through absl) shown only at DEBUG: the
    loader logs its own line.

    NOTE: absl sets up the root logger (``logging.basicConfig``) at its first line where the
    root has no handler, and a notebook's ``LLM`` then printed every jaxserve line twice: a
    root with no handler gets a silent one meanwhile."""
    logger = logging.getLogger("absl")
    level = logger.level
    root = logging.getLogger()
    silent = logging.NullHandler() if not root.handlers else None
    if silent is not None:
        root.addHandler(silent)
    if not logging.getLogger("jaxserve").isEnabledFor(logging.DEBUG):
        logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
        if silent is not None:
            root.removeHandler(silent)


class ConvertedCheckpointError(ValueError):
    """A converted checkpoint that does not fit what is served: names both sides."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a converted checkpoint holds (``jaxserve_checkpoint.json``)."""

    jaxserve_version: str
    dtype: str  # the weights' dtype ("bfloat16"); f32 fields stay f32
    quantization: str | None  # "fp8" | "int8" (quantized on conversion) | None
    fused: bool  # q/k/v and gate/up joined (the one-device layout, where they can be)
    model_type: str
    num_layers: int
    num_bytes: int
    leaves: dict[str, str]  # leaf path -> dtype[shape]: ".layers[0].wo": "bfloat16[32,128,4096]"
    kv_scales: list[list[float]] | None = None  # per layer [k, v], where the source had them
    num_kv_scales_from_checkpoint: int = 0
    format_version: int = FORMAT_VERSION

    def describe(self) -> str:
        """``bfloat16, fp8 quantized, q/k/v and gate/up fused``: the start-up log's words."""
        quant = f"{self.quantization} quantized" if self.quantization else "unquantized"
        layout = "q/k/v and gate/up fused" if self.fused else "q/k/v and gate/up apart"
        return f"{self.dtype}, {quant}, {layout}"


def is_converted_checkpoint(model_dir: str | os.PathLike[str]) -> bool:
    """Whether ``model_dir`` holds a checkpoint ``jaxserve convert`` wrote (its manifest)."""
    return (Path(model_dir) / MANIFEST_NAME).is_file()


def read_manifest(model_dir: str | os.PathLike[str]) -> Manifest:
    path = Path(model_dir) / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path}: not a readable manifest: {exc}") from exc
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != FORMAT_VERSION:
        raise WeightsError(
            f"{path}: format_version={version!r}; this jaxserve reads format_version "
            f"{FORMAT_VERSION} (convert the model again with this version)"
        )
    names = {f.name for f in dataclasses.fields(Manifest)}
    try:
        return Manifest(**{k: v for k, v in raw.items() if k in names})
    except TypeError as exc:  # a field missing
        raise WeightsError(f"{path}: not a whole manifest: {exc}") from exc


def leaf_table(weights: Any) -> dict[str, str]:
    """Leaf path -> ``dtype[shape]`` of a pytree of arrays (or of shapes)."""
    return {
        jax.tree_util.keystr(path): f"{np.dtype(leaf.dtype).name}[{','.join(map(str, leaf.shape))}]"
        for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]
    }


def check_served_as(
    manifest: Manifest, model_dir: Path, dtype: Any, quantization: str | None, fused: bool | None
) -> None:
    """The checkpoint holds weights of ``dtype`` and ``quantization``, in a layout the
    placement can take (a fused checkpoint serves on one device only; ``fused`` None: either)."""
    served = np.dtype(dtype).name
    if manifest.dtype != served:
        raise ConvertedCheckpointError(
            f"{model_dir} holds {manifest.dtype} weights (converted with --dtype "
            f"{manifest.dtype}); the model is served in {served}: serve it with --dtype "
            f"{manifest.dtype} or auto, or convert again with --dtype {served}"
        )
    if manifest.quantization != quantization:
        raise ConvertedCheckpointError(
            f"{model_dir} holds weights quantized with {manifest.quantization or 'none'} "
            f"(converted with --quantization {manifest.quantization or '(none)'}); the model is "
            f"served with quantization {quantization or 'none'}: leave --quantization out, or "
            "convert again with the quantization served"
        )
    if manifest.fused and fused is False:
        raise ConvertedCheckpointError(
            f"{model_dir} holds q/k/v and gate/up fused (converted for one device, "
            "--tensor-parallel-size 1); a tensor-parallel model serves them apart: convert "
            "again with the --tensor-parallel-size served"
        )


def check_leaves(manifest: Manifest, model_dir: Path, target: Any) -> None:
    """Every leaf of ``target`` is in the checkpoint with its shape and dtype, and no other:
    a ``WeightsError`` naming each that is not, before anything is read."""
    wanted = leaf_table(target)
    held = manifest.leaves
    problems = [f"{path}: not a weight of this model" for path in held if path not in wanted]
    for path, leaf in wanted.items():
        have = held.get(path)
        if have is None:
            problems.append(f"{path}: missing")
        elif have != leaf:
            problems.append(f"{path}: {have} in the checkpoint, the model's is {leaf}")
    if problems:
        shown = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
        raise WeightsError(f"{model_dir}: {len(problems)} weights do not fit the model: {shown}")


def restore_weights(model_dir: str | os.PathLike[str], target: Any) -> Any:
    """The checkpoint's weights, laid out as ``target`` (a pytree of ``jax.ShapeDtypeStruct``):
    a leaf with a sharding is restored straight into it (each device, each host, reads only its
    own shards); one without, into host memory (numpy). Checked leaf by leaf first."""
    model_dir = Path(model_dir)
    check_leaves(read_manifest(model_dir), model_dir, target)

    def restore_as(leaf: jax.ShapeDtypeStruct) -> Any:
        if leaf.sharding is None:
            return np.empty(leaf.shape, leaf.dtype)  # a marker: restored as numpy
        return leaf

    abstract = jax.tree.map(restore_as, target)
    with _orbax_quiet():
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore((model_dir / WEIGHTS_DIR).absolute(), abstract)


def write_checkpoint(
    weights: Any,
    source_dir: Path,
    out: Path,
    manifest: Manifest,
    show_progress: bool = True,
) -> float:
    """``weights`` saved with orbax into ``out``/weights, the source's other files copied and the
    manifest written last; the seconds the weights took to write."""
    is_first = jax.process_index() == 0  # on several hosts, one writes the small files
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: convert into a new directory")
    if is_first:
        out.mkdir(parents=True, exist_ok=True)
        copy_model_files(source_dir, out)
    start = time.perf_counter()
    with _orbax_quiet():
        import orbax.checkpoint as ocp

        # NOTE: uncompressed (orbax's default is zstd): weights gain little from it (bf16
        # about a fifth, fp8 less) and every start pays for decoding it. On this project's
        # 2-core CI machine, 1 GiB of bf16 wrote in 0.8-1.2 s instead of 4.4 s and restored in
        # 1.3-1.5 s instead of 1.7-2.1 s. A compressed checkpoint still restores (the codec is in
        # its metadata).
        handler = ocp.PyTreeCheckpointHandler(use_compression=False)
        with ocp.AsyncCheckpointer(handler) as checkpointer:
            checkpointer.save((out / WEIGHTS_DIR).absolute(), args=ocp.args.PyTreeSave(weights))
            _wait_with_progress(checkpointer, out, manifest.num_bytes, show_progress)
    seconds = time.perf_counter() - start
    if is_first:
        text = json.dumps(dataclasses.asdict(manifest), indent=1)
        (out / MANIFEST_NAME).write_text(text + "\n")
    return seconds


def copy_model_files(source_dir: Path, out: Path) -> list[str]:
    """config.json, generation_config.json, the tokenizer's and chat template's files: every
    file of the source directory but its weights; the names copied."""
    copied = []
    for path in sorted(source_dir.iterdir()):
        if not path.is_file() or path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if path.name.endswith(".index.json") or path.name == MANIFEST_NAME:
            continue
        shutil.copy2(path, out / path.name)
        copied.append(path.name)
    return copied


def _wait_with_progress(checkpointer: Any, out: Path, total: int, show: bool) -> None:
    """Wait for orbax's background write, with a bar of the bytes on disk so far (the bar ends
    at the total once the write is done)."""
    from tqdm.auto import tqdm

    done = threading.Event()
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="Writing weights (orbax)",
        disable=not show,
    )

    def watch() -> None:
        while not done.wait(0.5):
            bar.n = min(total, _bytes_under(out))
            bar.refresh()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        checkpointer.wait_until_finished()
    finally:
        done.set()
        watcher.join()
        bar.n = total
        bar.close()


def _bytes_under(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # a temporary file orbax renamed meanwhile
                pass
    return total


def served_dtype(manifest: Manifest, model_dir: Path, requested: str) -> str:
    """The dtype ``--dtype`` serves a converted checkpoint in: ``auto`` its own; another than
    its own is a ``ConvertedCheckpointError`` naming both."""
    if requested not in ("auto", manifest.dtype):
        raise ConvertedCheckpointError(
            f"--dtype {requested} does not match {model_dir}, converted with --dtype "
            f"{manifest.dtype}: leave --dtype out (auto serves the checkpoint's), or convert "
            f"again with --dtype {requested}"
        )
    return manifest.dtype


def served_quantization(manifest: Manifest, model_dir: Path, requested: str | None) -> str | None:
    """The quantization a converted checkpoint serves with: None (no flag) its own; another
    than its own is a ``ConvertedCheckpointError`` naming both."""
    if requested is not None and requested != manifest.quantization:
        raise ConvertedCheckpointError(
            f"--quantization {requested} does not match {model_dir}, converted with "
            f"--quantization {manifest.quantization or '(none)'}: leave --quantization out "
            f"(the checkpoint's is served), or convert again with --quantization {requested}"
        )
    return manifest.quantization
