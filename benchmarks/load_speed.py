"""Loading a safetensors checkpoint from the page cache: GB/s, and where the time goes.

Writes a checkpoint with a model config's tensor names and shapes (bf16 noise), split over
--num-shards files with an index as Hugging Face writes them, reads it once so it sits in the
page cache, then times on the same files, in this order (each GB/s over the checkpoint's bytes):
  load_weights            the loader as the engine calls it: the first call compiles its
                          conversion programs, the second reuses them (default threads, staging)
  read, N threads         the loader's positioned reads into reusable buffers, nothing else
  safetensors get_tensor  the same bytes through safetensors' own reader (a new array each)
  read + device_put       + each piece sent to the device (no conversion)
  old loader              the loader before this script (one tensor at a time: safe_open's
                          get_tensor, the transpose and cast in numpy, jax.device_put), timed
                          stage by stage: read, host convert, device_put
  sweep                   load_weights by number of threads and staging memory
Peak host memory (max RSS) is printed after the new loader's runs, before the old one maps the
files. Measurements stop when --time-budget seconds have passed (the rest is listed as skipped).

    python -m benchmarks.load_speed                          # Llama-3-8B: 15 GB in 4 shards
    python -m benchmarks.load_speed --num-layers 4 --vocab-size 32000  # 1.9 GB, CPU-sized
    python -m benchmarks.load_speed --smoke                  # tiny (CI smoke test)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxserve.config import ModelConfig, builtin_config_dir
from jaxserve.models.families.fields import HF_LAYER_PREFIX
from jaxserve.models.families.registry import layer_fields, load_model_config, model_fields
from jaxserve.models.loading.checkpoint_loader import (
    STAGING_BYTES,
    default_num_threads,
    load_weights,
)
from jaxserve.models.loading.checkpoint_reader import CheckpointReader, read_header

MiB = 1024**2


def hf_order(names: list[str]) -> list[str]:
    """Hugging Face's shard order: the embedding, the layers in order, the rest."""

    def key(name: str) -> tuple[int, int, str]:
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (0 if "embed" in name else 2, 0, name)

    return sorted(names, key=key)


def write_checkpoint(config_dir: Path, out: Path, overrides: dict, num_shards: int) -> int:
    """A bf16 checkpoint of the config's tensors in ``out``; returns its tensor bytes."""
    hf = json.loads((config_dir / "config.json").read_text()) | overrides
    hf["torch_dtype"] = "bfloat16"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf))
    config = load_model_config(out)
    shapes = {field.hf_name: field.checkpoint_shape_for(config) for field in model_fields(config)}
    for layer in range(config.num_layers):
        for field in layer_fields(config, layer):
            for name in field.hf_names(config, HF_LAYER_PREFIX.format(layer=layer)):
                shapes[name] = field.checkpoint_shape_for(config)
    names = hf_order(list(shapes))
    sizes = {name: int(np.prod(shapes[name])) * 2 for name in names}
    total = sum(sizes.values())
    noise = (np.random.default_rng(0).standard_normal(MiB) * 0.02).astype(ml_dtypes.bfloat16)
    block = noise.view(np.uint8)  # 2 MiB of bf16 values, repeated
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    written = 0
    for name in names:  # contiguous runs of about total / num_shards bytes
        shards[min(num_shards - 1, written * num_shards // total)].append(name)
        written += sizes[name]
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        header, offset = {}, 0
        for name in shard:
            header[name] = {
                "dtype": "BF16",
                "shape": list(shapes[name]),
                "data_offsets": [offset, offset + sizes[name]],
            }
            offset += sizes[name]
            weight_map[name] = file
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(out / file, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for name in shard:
                left = sizes[name]
                while left:
                    chunk = block[: min(left, block.size)]
                    f.write(chunk)
                    left -= chunk.size
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return total


def tensor_files(model_dir: Path) -> dict[str, Path]:
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return {name: model_dir / file for name, file in weight_map["weight_map"].items()}


def read_only(model_dir: Path, num_threads: int, buffer_bytes: int = 64 * MiB) -> None:
    """Every tensor's bytes into a reusable buffer per thread (the reader's reads alone)."""
    infos = [
        i for f in sorted(set(tensor_files(model_dir).values())) for i in read_header(f).values()
    ]
    fds = {file: os.open(file, os.O_RDONLY) for file in {i.file for i in infos}}
    buffers = [np.empty(buffer_bytes, np.uint8) for _ in range(num_threads)]

    def read(part: int) -> None:
        buffer = buffers[part]
        for info in infos[part::num_threads]:
            for start in range(info.begin, info.end, buffer_bytes):
                size = min(buffer_bytes, info.end - start)
                os.preadv(fds[info.file], [buffer[:size]], start)

    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(read, range(num_threads)))
    for fd in fds.values():
        os.close(fd)


def safetensors_read(model_dir: Path, num_threads: int) -> None:
    """Every tensor through safetensors' own get_tensor (a new array each), in threads."""
    files = tensor_files(model_dir)
    names = hf_order(list(files))

    def read(part: int) -> None:
        handles = {file: safe_open(file, framework="numpy") for file in set(files.values())}
        for name in names[part::num_threads]:
            handles[files[name]].get_tensor(name)

    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(read, range(num_threads)))


def read_and_put(model_dir: Path, num_threads: int) -> None:
    """Every tensor through the loader's reader to the device, not converted."""
    files = tensor_files(model_dir)
    buffer_bytes = STAGING_BYTES // (2 * num_threads) // 64 * 64
    with (
        CheckpointReader(files, None, 2 * num_threads, buffer_bytes) as reader,
        concurrent.futures.ThreadPoolExecutor(num_threads) as pool,
    ):
        read = lambda name: jax.block_until_ready(reader.read_to_device([name]))
        list(pool.map(read, hf_order(list(files))))


def old_loader(model_dir: Path, config: ModelConfig) -> dict[str, float]:
    """The loader before parallel reads, stage by stage: seconds in each."""
    files = tensor_files(model_dir)
    fields = [(f, "") for f in model_fields(config)] + [
        (f, HF_LAYER_PREFIX.format(layer=layer))
        for layer in range(config.num_layers)
        for f in layer_fields(config, layer)
    ]
    seconds = {"read": 0.0, "host convert": 0.0, "device_put": 0.0}
    handles = {file: safe_open(file, framework="numpy") for file in set(files.values())}
    arrays = []
    for field, prefix in fields:
        start = time.perf_counter()
        tensors = [handles[files[n]].get_tensor(n) for n in field.hf_names(config, prefix)]
        seconds["read"] += time.perf_counter() - start
        start = time.perf_counter()
        parts = [field.from_hf(t, config) for t in tensors]
        array = parts[0] if not field.per_expert else np.stack(parts)
        array = array.astype(jnp.bfloat16, copy=False)
        seconds["host convert"] += time.perf_counter() - start
        start = time.perf_counter()
        arrays.append(jax.device_put(array).block_until_ready())
        seconds["device_put"] += time.perf_counter() - start
    del arrays, handles
    return seconds


def max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to write it (default: a temp dir)")
    parser.add_argument("--threads", default="1,4,8,16", help="the sweep's thread counts")
    parser.add_argument("--staging-mib", default="256,1024,4096", help="the sweep's staging")
    parser.add_argument("--time-budget", type=float, default=150.0)
    parser.add_argument("--smoke", action="store_true", help="the tiny llama fixture, CPU")
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--write-only", action="store_true", help="write the checkpoint to --dir, time nothing"
    )
    args = parser.parse_args()
    if args.smoke:
        args.model = str(Path(__file__).parents[1] / "tests/fixtures/models/llama")
        args.num_shards, args.threads, args.staging_mib = 2, "1,2", "1"
    overrides = {"num_hidden_layers": args.num_layers, "vocab_size": args.vocab_size}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    model_dir = Path(args.dir or tempfile.mkdtemp(prefix="jaxserve-load-speed-"))
    began = time.perf_counter()
    num_bytes = write_checkpoint(Path(args.model), model_dir, overrides, args.num_shards)
    config = load_model_config(model_dir)
    print(f"wrote {num_bytes / 1e9:.2f} GB in {args.num_shards} shards to {model_dir} in "
          f"{time.perf_counter() - began:.1f} s; {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    if args.write_only:
        return
    read_only(model_dir, default_num_threads())  # into the page cache
    rows: list[dict] = []
    skipped: list[str] = []

    def measure(name: str, fn) -> None:
        if time.perf_counter() - began > args.time_budget:
            skipped.append(name)
            return
        gc.collect()
        start = time.perf_counter()
        jax.block_until_ready(fn())
        seconds = time.perf_counter() - start
        rows.append({"name": name, "seconds": seconds, "gb_per_s": num_bytes / seconds / 1e9})
        print(f"{name:<40} {seconds:7.2f} s  {num_bytes / seconds / 1e9:6.2f} GB/s", flush=True)

    threads = default_num_threads()
    load = lambda **kw: lambda: load_weights(model_dir, config, jnp.bfloat16, **kw)
    measure(f"load_weights, {threads} threads (compiles)", load())
    measure(f"load_weights, {threads} threads", load())
    rss = max_rss_gib()
    print(f"max RSS so far: {rss:.2f} GiB (checkpoint {num_bytes / 1024**3:.2f} GiB)")
    measure(f"read, {threads} threads", lambda: read_only(model_dir, threads))
    measure(f"safetensors get_tensor, {threads} threads",
            lambda: safetensors_read(model_dir, threads))  # fmt: skip
    measure(f"read + device_put, {threads} threads", lambda: read_and_put(model_dir, threads))
    if time.perf_counter() - began <= args.time_budget:
        start = time.perf_counter()
        stages = old_loader(model_dir, config)
        seconds = time.perf_counter() - start
        rows.append({"name": "old loader", "seconds": seconds, **stages,
                     "gb_per_s": num_bytes / seconds / 1e9})  # fmt: skip
        print(f"{'old loader (1 thread)':<40} {seconds:7.2f} s  {num_bytes / seconds / 1e9:6.2f} "
              f"GB/s: " + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()))  # fmt: skip
    else:
        skipped.append("old loader")
    for n in [int(t) for t in args.threads.split(",")]:
        measure(f"load_weights, {n} threads", load(num_threads=n))
    for mib in [int(m) for m in args.staging_mib.split(",")]:
        measure(f"load_weights, {threads} threads, {mib} MiB staging",
                load(staging_bytes=mib * MiB))  # fmt: skip
    if skipped:
        print("skipped (time budget):", ", ".join(skipped))
    if args.output_json:
        result = {"bytes": num_bytes, "max_rss_gib_new_loader": rss, "rows": rows,
                  "skipped": skipped, "device": jax.devices()[0].device_kind}  # fmt: skip
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    if args.dir is None:
        shutil.rmtree(model_dir)


if __name__ == "__main__":
    main()
