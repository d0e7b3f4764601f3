"""A training loop's hooks on the Llama-3-8B shape (dummy weights, bf16), timed through ``LLM``:
``update_weights`` from arrays already on the device (the served layout), from host memory, and
from Hugging Face names and a flax.nnx state on the device (each converted on the device);
``sleep(1)`` / ``wake_up()`` and ``sleep(2)`` / ``wake_up()``, with the device memory held while
asleep; and that the tokens after each round trip are the tokens before.

Device memory is read two ways: ``bytes_in_use`` of JAX's allocator (what a trainer in the same
process can use again) and the process's memory as the driver sees it (``nvidia-smi``: what
another process can use). Run it once per allocator to compare, e.g. with
``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (memory goes back to the driver when freed).

    python -m benchmarks.weight_updates --out weight_updates.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ROOT
from jaxserve import LLM, SamplingParams
from jaxserve.models.loading.checkpoint_loader import expected_shapes
from jaxserve.models.loading.named_weights import nnx_from_hf

GiB = 2**30

# The allocator's pool is most of the device and the engine plans its share of it
# (--gpu-memory-utilization), so the copies below have room beside the engine, as a trainer's
# arrays would. Set before JAX's backend starts (importing jax does not start it).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")


def memory() -> dict[str, float]:
    """GiB: JAX's live allocations on device 0, and this process's memory per the driver."""
    stats = jax.devices()[0].memory_stats() or {}
    held = None
    try:
        rows = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        for row in rows:
            pid, used = (field.strip() for field in row.split(","))
            if int(pid) == os.getpid():
                held = int(used) / 1024  # MiB -> GiB
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    return {"in_use_gib": stats.get("bytes_in_use", 0) / GiB, "driver_gib": held}


def timed(action: Callable[[], Any], label: str = "") -> float:
    start = time.perf_counter()
    jax.block_until_ready(action())
    seconds = time.perf_counter() - start
    if label:  # as it goes: a run cut off still tells how far it got
        print(
            f"{label:<24} {seconds:8.3f} s   ({memory()['in_use_gib']:.1f} GiB in use)", flush=True
        )
    return seconds


def tokens(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([[(7 * i) % 251 + 5 for i in range(128)]], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def update_rows(llm: LLM) -> dict[str, float]:
    """Seconds of each ``update_weights`` source, the served weights handed back each time.
    Each source is let go before the next is made, so that at most two more copies of the
    weights are on the device at once (the sources, as a trainer's, and what the engine made
    of them): an 80 GiB card ran out of memory holding four."""
    served = llm.weights
    rows = {}
    copies = jax.tree.map(jnp.copy, served)  # other arrays, the served dtype and sharding
    jax.block_until_ready(copies)
    rows["update_device_s"] = timed(
        functools.partial(llm.update_weights, copies), "update_device_s"
    )
    llm.update_weights(served)
    del copies
    host = jax.device_get(served)
    rows["update_host_s"] = timed(functools.partial(llm.update_weights, host), "update_host_s")
    llm.update_weights(served)
    del host
    hf = hf_named_on_device(llm)  # as a trainer's state_dict names them, on the device
    rows["update_hf_device_s"] = timed(
        functools.partial(llm.update_weights, hf), "update_hf_device_s"
    )
    llm.update_weights(served)
    nnx_state = nnx_from_hf(hf)  # as flax.nnx lays them out (kernels [in, out])
    del hf
    jax.block_until_ready(nnx_state)
    rows["update_nnx_device_s"] = timed(
        functools.partial(llm.update_weights, nnx_state), "update_nnx_device_s"
    )
    return rows


def hf_named_on_device(llm: LLM) -> dict[str, jax.Array]:
    """Random bf16 tensors under every Hugging Face name the model reads, on the device."""
    shapes = expected_shapes(llm.engine.model_config)
    key = jax.random.key(1)
    tensors = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        assert shape is not None
        tensors[name] = 0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
    return jax.block_until_ready(tensors)


def transfer_rows(weights: Any) -> dict[str, float]:
    """Seconds to move the weights between the device and host memory, each way, the whole
    tree in one ``device_put``: through pageable numpy arrays (how level 1 slept before, and
    still does where the backend has no pinned host memory) and through pinned host memory
    (``memory_kind="pinned_host"``, how it sleeps now: a DMA each way)."""
    leaves = jax.tree.leaves(weights)
    rows: dict[str, float] = {}
    start = time.perf_counter()
    host = [np.asarray(leaf) for leaf in leaves]
    rows["to_host_pageable_s"] = time.perf_counter() - start
    put = functools.partial(jax.device_put, host)
    del host
    rows["from_host_pageable_s"] = timed(put, "from_host_pageable_s")
    del put
    pinned_at = [leaf.sharding.with_memory_kind("pinned_host") for leaf in leaves]
    start = time.perf_counter()
    pinned = jax.block_until_ready(jax.device_put(leaves, pinned_at))
    rows["to_host_pinned_s"] = time.perf_counter() - start
    at = [leaf.sharding for leaf in leaves]
    rows["from_host_pinned_s"] = timed(lambda: jax.device_put(pinned, at), "from_host_pinned_s")
    return rows


def sleep_rows(llm: LLM, level: int) -> dict[str, Any]:
    row: dict[str, Any] = {"awake": memory()}
    row["sleep_s"] = timed(lambda: llm.sleep(level))
    row["asleep"] = memory()
    # in two parts, each until its arrays are on the device: where the time of a wake goes
    row["wake_weights_s"] = timed(lambda: (llm.wake_up(["weights"]), llm.weights)[1])
    row["wake_kv_cache_s"] = timed(
        lambda: (llm.wake_up(["kv_cache"]), llm.engine.runner.kv_cache)[1]
    )
    row["wake_s"] = row["wake_weights_s"] + row["wake_kv_cache_s"]
    row["woken"] = memory()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "jaxserve/assets/configs/llama-3-8b"))
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", default="weight_updates.json")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="the engine's share of the device (weights and KV cache); the rest holds the copies",
    )
    args = parser.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_sleep_mode=True,
        # A trainer beside the engine keeps its share: the updates below hold up to three more
        # copies of the weights (device arrays, Hugging Face names, flax.nnx) on the device.
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    before = tokens(llm)
    result: dict[str, Any] = {"allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "bfc")}
    served = llm.weights
    result.update(update_rows(llm))
    # The weights the tokens were made with, as new arrays: ``served`` keeps a host copy from
    # ``device_get`` above, which would make level 1's own copy to the host look free; and a
    # reference here would keep the weights on the device while asleep.
    llm.update_weights(jax.tree.map(jnp.copy, served))
    del served
    result["tokens_after_updates"] = tokens(llm) == before
    result["level1"] = sleep_rows(llm, 1)
    result["tokens_after_level1"] = tokens(llm) == before
    # Again: the first level-1 sleep took 6.6-7.6 s where a pinned copy of the same weights
    # took 0.3 s after it (H100); the first pins 15 GiB of host memory, a second may reuse it.
    result["level1_again"] = sleep_rows(llm, 1)
    result["tokens_after_level1_again"] = tokens(llm) == before
    result["level2"] = sleep_rows(llm, 2)  # dummy weights wake as the same random ones
    result["tokens_after_level2"] = tokens(llm) == before
    try:  # the floor of a level-1 round trip, each way (the wake's 7.6 s on the H200 was 3x
        # update_weights' from host memory)
        result["transfers"] = transfer_rows(llm.weights)
    except Exception as exc:  # e.g. no pinned host memory on this backend
        result["transfers"] = {"error": str(exc)[:300]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"allocator {result['allocator']}")
    for key, value in result.items():
        if key.endswith("_s"):
            print(f"{key:<24} {value:8.3f} s")
    for level in ("level1", "level1_again", "level2"):
        row = result[level]
        print(
            f"{level}: sleep {row['sleep_s']:.2f} s, wake {row['wake_s']:.2f} s (weights "
            f"{row['wake_weights_s']:.2f}, KV cache {row['wake_kv_cache_s']:.2f}); GiB in use / "
            f"held by the process: awake {_gib(row['awake'])}, asleep {_gib(row['asleep'])}, "
            f"woken {_gib(row['woken'])}"
        )
    print(f"transfers: {result['transfers']}")
    same = [result[k] for k in result if k.startswith("tokens_after")]
    print(f"same tokens after every update and wake: {all(same)} {same}")


def _gib(row: dict[str, float | None]) -> str:
    driver = row["driver_gib"]
    return f"{row['in_use_gib']:.1f} / {'-' if driver is None else f'{driver:.1f}'}"


if __name__ == "__main__":
    main()
