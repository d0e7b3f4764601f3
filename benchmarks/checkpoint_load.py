"""Loading weights from safetensors against restoring a converted (orbax) checkpoint, at start
and as a weight update from disk.

Writes a bf16 safetensors checkpoint of dummy weights in Hugging Face's layout (the Llama-3-8B
shape by default, ``load_speed.write_checkpoint``), converts it with ``jaxserve convert`` (in
this process; the seconds are printed), then times, each to the weights ready on the device:
  (a) safetensors   the loader as a start calls it (``model_weights``), first and best run
  (b) orbax         the converted checkpoint restored as a start restores it (straight into
                    the device), and as it did before (into host memory, then put on the device)
  (c) update        ``LLM.update_weights_from_disk`` from each, on an engine started with random
                    weights (small KV cache, no warm-up), first and best run
Both checkpoints were just written, so their files sit in the page cache: the times are of
reading from memory, not from the disk (drop the page cache as root between runs for those).

    python -m benchmarks.checkpoint_load --out /tmp/checkpoint_load.json    # Llama-3-8B, bf16
    python -m benchmarks.checkpoint_load --smoke --out /tmp/smoke.json      # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import ROOT
from benchmarks.load_speed import write_checkpoint
from jaxserve import cli
from jaxserve.config import builtin_config_dir
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.runner.model_weights import model_weights


def time_load(model_dir: Path, runs: int) -> list[float]:
    """Seconds of each start-up load of ``model_dir`` (bf16, one device), weights on the device."""
    config = EngineConfig(model=str(model_dir), dtype="bfloat16")
    model_config = load_model_config(model_dir)
    times = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        weights, _ = model_weights(model_config, config, jnp.dtype(jnp.bfloat16), None, None)
        jax.block_until_ready(weights)
        times.append(time.perf_counter() - start)
        del weights
    return times


def time_restore_via_host(orbax_dir: Path, runs: int) -> list[float]:
    """Seconds of each restore of the converted checkpoint into host memory, then put on the
    default device: how a start restored one device's weights before it restored them straight
    into the device (the second copy was the suspect of orbax's gap to safetensors)."""
    from jaxserve.models.loading.orbax_checkpoint import read_manifest, restore_weights
    from jaxserve.runner.model_weights import _abstract_in_layout

    model_config = load_model_config(orbax_dir)
    manifest = read_manifest(orbax_dir)
    shapes = _abstract_in_layout(model_config, jnp.dtype(jnp.bfloat16), None, manifest.fused, None)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)  # no sharding
    times = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        weights = jax.block_until_ready(jax.device_put(restore_weights(orbax_dir, target)))
        times.append(time.perf_counter() - start)
        del weights
    return times


def time_updates(safetensors_dir: Path, orbax_dir: Path, runs: int) -> dict[str, list[float]]:
    """Seconds of each ``update_weights_from_disk`` from either checkpoint, in turns."""
    llm = LLM(
        str(safetensors_dir),
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        num_gpu_blocks_override=64,
        warmup=False,
    )
    times: dict[str, list[float]] = {"safetensors": [], "orbax": []}
    for _ in range(runs):
        for name, path in (("safetensors", safetensors_dir), ("orbax", orbax_dir)):
            gc.collect()
            start = time.perf_counter()
            llm.update_weights_from_disk(path)
            jax.block_until_ready(llm.weights)
            times[name].append(time.perf_counter() - start)
    llm.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each (first, best)")
    parser.add_argument("--dir", default=None, help="where to write both (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="the tiny llama fixture, CPU")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.runs = str(ROOT / "tests/fixtures/models/llama"), 2
    work = Path(args.dir or tempfile.mkdtemp(prefix="jaxserve-checkpoint-load-"))
    safetensors_dir, orbax_dir = work / "safetensors", work / "orbax"
    try:
        began = time.perf_counter()
        num_bytes = write_checkpoint(Path(args.model), safetensors_dir, {}, num_shards=4)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (Path(args.model) / name).is_file():
                shutil.copy(Path(args.model) / name, safetensors_dir / name)
        wrote = time.perf_counter() - began
        began = time.perf_counter()
        command = ["convert", str(safetensors_dir), str(orbax_dir), "--dtype", "bfloat16"]
        if cli.main(command) != 0:
            raise SystemExit("jaxserve convert failed")
        converted = time.perf_counter() - began
        loads = {
            "safetensors": time_load(safetensors_dir, args.runs),
            "orbax": time_load(orbax_dir, args.runs),
            "orbax, via host memory": time_restore_via_host(orbax_dir, args.runs),
        }
        updates = time_updates(safetensors_dir, orbax_dir, args.runs)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report(args, num_bytes, wrote, converted, loads, updates)


def report(args, num_bytes: int, wrote: float, converted: float, loads, updates) -> None:
    device = jax.devices()[0].device_kind
    print(f"\n{Path(args.model).name}: {num_bytes / 1e9:.2f} GB bf16 on {device}; safetensors "
          f"written in {wrote:.1f} s, `jaxserve convert` in {converted:.1f} s")  # fmt: skip
    print(f"{'weights ready on the device':<38} {'first s':>8} {'best s':>8} {'GB/s':>7}")
    rows = []
    for what, table in (("start", loads), ("update_weights_from_disk", updates)):
        for source, times in table.items():
            best = min(times)
            row = {"what": what, "source": source, "first_s": times[0], "best_s": best,
                   "gb_per_s": num_bytes / best / 1e9}  # fmt: skip
            rows.append(row)
            label = f"{what}, {source}"
            print(f"{label:<38} {times[0]:8.2f} {best:8.2f} {row['gb_per_s']:7.2f}")
    if args.out:
        meta = {"model": args.model, "device": device, "bytes": num_bytes, "runs": args.runs,
                "write_safetensors_s": wrote, "convert_s": converted}  # fmt: skip
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
