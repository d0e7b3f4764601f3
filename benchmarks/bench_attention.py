"""Ragged paged attention: the GPU kernels against their KV-read floor and the XLA reference.

Default suite: the Mosaic GPU kernel at the Llama-3-8B attention shape (32 query heads, 8 KV
heads, head_dim 128, bf16, page 16, shuffled page tables). Decode at batch {1, 8, 64, 256} x
context {1024, 4096}, and mixed batches of one 2048-token prefill chunk (a fresh prompt) plus
63 decodes.

``--suite tiers``: the pre-Hopper tier (the Pallas Triton kernel, forced on this GPU) at the
Llama-3-8B shape, and the Mosaic GPU kernel at the Gemma-2-9B shape (16 / 8 heads, head_dim
256, soft cap 50, window 4096), each beside the XLA reference; the Triton kernel also over a
few configs at batch 64 x 4096. Target: Triton >= 40% of the floor at decode b=64 ctx=4096.
Mixed batches there skip the reference (its dense gather needs tens of GB at head_dim 256) and
compare against the first kernel instead.

``--suite sinks``: gpt-oss-20b's attention (64 / 8 heads, head_dim 64; full and 128-token
window layers) with and without attention sinks, each GPU kernel beside the XLA reference, so
that the cost of the sinks (and the unchanged no-sinks path) shows side by side in one run.

``--suite prompts``: whole prompts, where attention is bound by compute: 64 prompts of 256
tokens and 16 of 1,024 at the Qwen3-0.6B shape (16 / 8 heads, head_dim 128: the embedding
benchmark's step), one 2,048-token and eight 256-token Llama-3-8B prompts; TFLOP/s over the
causal pairs, against the bf16 peak. ``--sweep`` adds tile configs and the Triton kernel.

``--suite fp8``: the Mosaic GPU kernel at the Llama-3-8B shape over a bf16 cache, and over an
fp8 e4m3 cache (the same pages quantized at a per-tensor scale) by both fp8 paths: ``convert``
(tiles converted to bf16 in shared memory, ``JAXSERVE_FP8_ATTENTION=convert``) and ``native``
(fp8 wgmmas, ``KernelConfig(fp8_wgmma=True)``, the serving default). Decode at batch
{1, 8, 64, 256} x context {1024, 4096} and one mixed batch; errors are against the bf16 kernel
(so they include the cache's quantization). A second table gives tokens/s and each fp8 path's
speed-up over the bf16 kernel; target: native >= 1.6x at batch 64 x 4096. ``--sweep`` adds
native tile configs and an e5m2 cache.

Timing: device time from CUPTI (the sum of the call's kernel durations: the tile plan, the
attention kernel, the split merge), median over ``--reps`` calls, each call with its own random
page table over a KV pool of at least ``--pool-mib`` so that small cases are not served from L2.
The wall time of one call (dispatch included) is reported beside it. ``--out`` is written after
every case (``"partial": true``) and whole at the end, so a run cut off keeps what it timed.
Floor: (KV read + Q read + O write) bytes at 4.3 TB/s, the device-to-device copy rate measured
on the H200 (the script also measures a 1 GiB copy in the same run).

  python3 -m benchmarks.bench_attention --out /tmp/attn.json               # on the GPU
  python3 -m benchmarks.bench_attention --suite tiers --out /tmp/tiers.json
  python3 -m benchmarks.bench_attention --suite sinks --out /tmp/sinks.json
  python3 -m benchmarks.bench_attention --suite fp8 --out /tmp/fp8.json
  python3 -m benchmarks.bench_attention --suite prompts --sweep --out /tmp/prompts.json
  python3 -m benchmarks.bench_attention --suite fp8 --slots 256 --page-size 64   # as served

A case's launch has one page-table row per sequence unless ``--slots`` pads it as the runner
does (its token bucket, ``--max-num-seqs`` rows, ``--max-model-len`` positions): the KV splits
are planned from those, so a lone batch-1 launch splits otherwise than a served step (a batch-1 x
4,096 fp8 launch ran 2x faster at 128 KV tokens a step where the step was slower, 2026-12-06).
  python -m benchmarks.bench_attention --smoke [--suite tiers]              # tiny, CPU interpret
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import BANDWIDTH
from jaxserve.units import cdiv
from pallas_kernels.kv_cache import quantize_kv
from pallas_kernels.ragged_paged_attention import mosaic_gpu, reference
from pallas_kernels.ragged_paged_attention import triton as triton_kernel


@dataclasses.dataclass(frozen=True)
class Shape:
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    soft_cap: float | None = None
    sliding_window: int | None = None
    has_sinks: bool = False  # attention sinks (GPT-OSS): one fixed random logit per query head

    def attention_kwargs(self) -> dict:
        kwargs = dict(
            sm_scale=self.head_dim**-0.5,
            soft_cap=self.soft_cap,
            sliding_window=self.sliding_window,
        )
        if self.has_sinks:
            sinks = np.random.default_rng(0).normal(0.5, 2.0, self.num_q_heads)
            kwargs.update(sinks=jnp.asarray(sinks, jnp.float32))
        return kwargs

    @property
    def label(self) -> str:
        label = f"{self.num_q_heads}/{self.num_kv_heads}x{self.head_dim}"
        if self.sliding_window is not None:
            label += f" w{self.sliding_window}"
        if self.page_size != Shape.page_size:
            label += f" p{self.page_size}"
        return label + (" sinks" if self.has_sinks else "")


LLAMA_3_8B = Shape()
GEMMA_2_9B = Shape(num_q_heads=16, num_kv_heads=8, head_dim=256, soft_cap=50.0,
                   sliding_window=4096)  # fmt: skip
GPT_OSS_20B = Shape(num_q_heads=64, num_kv_heads=8, head_dim=64)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel configuration to time: ``call(*inputs, **attention_kwargs)``."""

    label: str
    call: Callable[..., jax.Array]
    head_major_kv: bool = False
    kv_dtype: Any = None  # an fp8 cache: the pool quantized to it at FP8_SCALE (K and V)


# The fp8 suite's per-tensor cache scale: N(0, 1) keys and values stay well inside e4m3's 448.
FP8_SCALE = 0.02


def mosaic(
    label: str, config: mosaic_gpu.KernelConfig, interpret: bool, kv_dtype: Any = None
) -> Variant:
    fn = functools.partial(mosaic_gpu.ragged_paged_attention, config=config, interpret=interpret)
    return Variant(label, fn, config.head_major_kv, kv_dtype)


def triton(label: str, config: triton_kernel.TritonConfig, interpret: bool) -> Variant:
    fn = functools.partial(triton_kernel.ragged_paged_attention, config=config, interpret=interpret)
    return Variant(label, fn)


@dataclasses.dataclass(frozen=True)
class Batch:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]


def decode_batch(batch: int, context: int) -> Batch:
    return Batch(f"decode b={batch} ctx={context}", (1,) * batch, (context,) * batch)


def mixed_batch(prefill: int, decodes: int, context: int) -> Batch:
    return Batch(
        f"mixed {prefill}+{decodes}x{context}",
        (prefill,) + (1,) * decodes,
        (prefill,) + (context,) * decodes,
    )


def prompt_batch(num_prompts: int, length: int) -> Batch:
    """Fresh prompts computed whole (an embedding step, or prefill without a cached prefix)."""
    return Batch(
        f"prompts {num_prompts}x{length}", (length,) * num_prompts, (length,) * num_prompts
    )


def causal_flops(shape: Shape, batch: Batch) -> float:
    """QK^T and PV of each query token over the keys it sees (its chunk's causal part)."""
    pairs = sum(
        q * (kv - q) + q * (q + 1) / 2 for q, kv in zip(batch.q_lens, batch.kv_lens, strict=True)
    )
    return 4 * shape.num_q_heads * shape.head_dim * pairs


@dataclasses.dataclass(frozen=True)
class Served:
    """Each case as the runner launches it (``--slots``): its tokens padded to the step's token
    bucket (a power of two, at least 16: ``runner.buckets``), a page table of ``slots`` rows
    (``--max-num-seqs``; the rows past the batch's are dead) and ``max_model_len`` positions a
    row. The kernels plan their KV splits from these, as in a served step."""

    slots: int
    max_model_len: int


def make_inputs(
    rng, shape: Shape, batch: Batch, num_calls: int, pool_bytes: int, served: Served | None = None
):
    """q, a KV pool, and one shuffled page table per call (disjoint pages when the pool allows);
    ``served``: padded as a served step is."""
    page = shape.page_size
    seq_pages = [cdiv(kv, page) for kv in batch.kv_lens]
    pages_per_seq = max(seq_pages)
    num_slots, num_tokens = len(seq_pages), sum(batch.q_lens)
    if served is not None:
        pages_per_seq = max(pages_per_seq, cdiv(served.max_model_len, page))
        num_slots = max(num_slots, served.slots)
        num_tokens = max(16, 1 << (num_tokens - 1).bit_length())
    needed = sum(seq_pages)
    page_bytes = page * shape.num_kv_heads * shape.head_dim * 2 * 2
    num_pages = max(needed, pool_bytes // page_bytes)
    tables = np.zeros((num_calls, num_slots, pages_per_seq), np.int32)
    for c in range(num_calls):
        order = rng.permutation(num_pages)[:needed]
        first = 0
        for i, n in enumerate(seq_pages):
            tables[c, i, :n] = order[first : first + n]
            tables[c, i, n:] = order[first]
            first += n
    kv_shape = (num_pages, page, shape.num_kv_heads, shape.head_dim)
    key_q, key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    q = jax.random.normal(key_q, (num_tokens, shape.num_q_heads, shape.head_dim), jnp.bfloat16)
    k = jax.random.normal(key_k, kv_shape, jnp.bfloat16)  # [P, page_size, Hkv, D]
    v = jax.random.normal(key_v, kv_shape, jnp.bfloat16)
    dead = num_slots - len(batch.q_lens)  # page-table rows past the batch (served steps)
    ends = np.cumsum(batch.q_lens)
    cu_q_lens = jnp.asarray(np.concatenate([[0], ends, [ends[-1]] * dead]), jnp.int32)
    kv_lens = jnp.asarray([*batch.kv_lens, *[0] * dead], jnp.int32)
    num_seqs = jnp.asarray([len(batch.q_lens)], jnp.int32)
    return q, k, v, kv_lens, jnp.asarray(tables), cu_q_lens, num_seqs


def count_bytes(shape: Shape, batch: Batch, kv_itemsize: int = 2) -> tuple[int, int]:
    """(KV bytes read, all bytes moved: KV read + Q read + O write), each element once."""
    kv = sum(batch.kv_lens) * shape.num_kv_heads * shape.head_dim * 2 * kv_itemsize
    qo = sum(batch.q_lens) * shape.num_q_heads * shape.head_dim * 2 * 2
    return kv, kv + qo


def _cupti():
    """The CUPTI hooks of jaxlib's Mosaic GPU extension, or None (CPU, or not built in)."""
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

        ext = mosaic_gpu_lib._mosaic_gpu_ext
        return ext if hasattr(ext, "_cupti_init") else None
    except (ImportError, AttributeError):
        return None


def time_calls(attention, inputs, reps: int) -> tuple[dict, jax.Array]:
    """Median device and wall seconds per call over `reps` calls with different page tables."""
    q, k, v, kv_lens, tables, cu_q_lens, num_seqs = inputs
    fn = jax.jit(attention)
    arg_sets = [(q, k, v, kv_lens, tables[r], cu_q_lens, num_seqs) for r in range(reps)]
    out = jax.block_until_ready(fn(*arg_sets[0]))  # compile and warm up
    walls = []
    for args in arg_sets:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - start)
    result = dict(wall_s=statistics.median(walls))
    ext = _cupti()
    if ext is None:
        return result, out
    ext._cupti_init()
    try:
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
    finally:
        timings = ext._cupti_get_timings(True)  # [(kernel name, ms)], launch order
    per_call = len(timings) // reps
    calls = [timings[r * per_call : (r + 1) * per_call] for r in range(reps)]
    total = [sum(ms for _, ms in c) * 1e-3 for c in calls]
    attn = [sum(ms for name, ms in c if "ragged_paged_attention" in name) * 1e-3 for c in calls]
    result.update(
        seconds=statistics.median(total),
        kernel_s=statistics.median(attn),
        num_kernels=per_call,
        kernels=sorted({name[:60] for name, _ in calls[0]}),
    )
    return result, out


def copy_rate(num_bytes: int = 1 << 30) -> float | None:
    """Bytes read + written per second by a large device-to-device copy (XLA negate)."""
    ext = _cupti()
    if ext is None:
        return None
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    fn = jax.jit(lambda x: -x)
    jax.block_until_ready(fn(x))
    ext._cupti_init()
    try:
        for _ in range(5):
            jax.block_until_ready(fn(x))
    finally:
        timings = ext._cupti_get_timings(True)
    return 2 * num_bytes / (statistics.median(ms for _, ms in timings) * 1e-3)


def run_case(rng, shape, batch, *, variants, reps, pool_bytes, with_reference=True, served=None):
    """One row per variant (and the reference first, unless ``with_reference`` is False: then
    errors are against the first variant that ran and ``x XLA ref`` is left out); errors over
    the batch's tokens (a served step's padding rows left out)."""
    inputs = make_inputs(rng, shape, batch, reps, pool_bytes, served)
    live = sum(batch.q_lens)
    kwargs = shape.attention_kwargs()
    rows, ref_s, ref_out = [], None, None
    if with_reference:
        ref_fn = functools.partial(reference.ragged_paged_attention, **kwargs)
        ref_time, ref_out = time_calls(ref_fn, inputs, reps)
        rows.append(dict(kernel="xla-reference", **ref_time))
        ref_s = ref_time.get("seconds", ref_time["wall_s"])
    quantized: dict = {}  # kv dtype -> (k, v) pages, shared by the variants that read them
    for variant in variants:
        q, k, v = inputs[:3]
        variant_kwargs = kwargs
        if variant.kv_dtype is not None:
            if variant.kv_dtype not in quantized:
                quantized[variant.kv_dtype] = tuple(
                    quantize_kv(x, variant.kv_dtype, FP8_SCALE) for x in (k, v)
                )
            k, v = quantized[variant.kv_dtype]
            variant_kwargs = dict(kwargs, k_scale=FP8_SCALE, v_scale=FP8_SCALE)
        if variant.head_major_kv:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        call_inputs = (q, k, v, *inputs[3:])
        try:
            call = functools.partial(variant.call, **variant_kwargs)
            timing, out = time_calls(call, call_inputs, reps)
        except Exception as e:  # noqa: BLE001  a failing variant must not end the sweep
            rows.append(dict(kernel=variant.label, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        if ref_out is None:
            ref_out = out
        got, want = out[:live].astype(jnp.float32), ref_out[:live].astype(jnp.float32)
        err = float(jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want))
        kv_itemsize = 2 if variant.kv_dtype is None else 1
        rows.append(dict(kernel=variant.label, rel_err=err, kv_itemsize=kv_itemsize, **timing))
    for row in rows:
        kv_bytes, all_bytes = count_bytes(shape, batch, row.pop("kv_itemsize", 2))
        floor_s = all_bytes / BANDWIDTH
        row.update(case=batch.name, kv_bytes=kv_bytes, all_bytes=all_bytes, floor_s=floor_s)
        row.update(shape=shape.label, num_tokens=sum(batch.q_lens))
        row.update(flops=causal_flops(shape, batch))
        seconds = row.get("seconds", row.get("wall_s"))
        if seconds:
            row["tb_per_s"] = all_bytes / seconds / 1e12
            row["floor_frac"] = floor_s / seconds
            if ref_s:
                row["vs_ref"] = ref_s / seconds
    return rows


def format_table(rows) -> str:
    lines = [
        "| shape | case | kernel | device us | attn kernel us | wall us | KV MB | TB/s | of floor"
        " | x XLA ref | rel err |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['shape']} | {r['case']} | {r['kernel']} | error: {r['error'][:80]} |||||||"
            )
            continue
        us = lambda key, r=r: f"{r[key] * 1e6:.1f}" if r.get(key) else "-"
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        vs_ref = f"{r['vs_ref']:.2f}" if "vs_ref" in r else "-"
        lines.append(
            f"| {r['shape']} | {r['case']} | {r['kernel']} | {us('seconds')} | {us('kernel_s')}"
            f" | {us('wall_s')} | {r['kv_bytes'] / 1e6:.1f} | {r['tb_per_s']:.2f}"
            f" | {r['floor_frac']:.0%} | {vs_ref} | {err} |"
        )
    return "\n".join(lines)


def tiers_plan(smoke: bool, sweep: bool) -> list[tuple[Shape, Batch, list[Variant], bool]]:
    """(shape, batch, variants, with_reference) for ``--suite tiers``."""
    forced = triton_kernel.TritonConfig()
    if smoke:
        small = Shape(num_q_heads=4, num_kv_heads=2, head_dim=64)
        gemma = dataclasses.replace(small, head_dim=256, soft_cap=50.0, sliding_window=32)
        return [
            (small, decode_batch(2, 40), [triton("triton", forced, True)], True),
            (
                gemma,
                mixed_batch(20, 2, 50),
                [mosaic("mosaic", mosaic_gpu.KernelConfig(), True)],
                False,
            ),
        ]
    decodes = [decode_batch(1, 4096), decode_batch(8, 4096), decode_batch(64, 1024)]
    decodes += [decode_batch(64, 4096), decode_batch(256, 1024)]
    mixed = mixed_batch(2048, 63, 4096)
    plan = []
    for batch in decodes + [mixed]:
        variants = [triton("triton", forced, False)]
        if sweep and batch.name == "decode b=64 ctx=4096":
            for warps, stages, block_kv in ((8, 2, 64), (4, 3, 64), (4, 2, 128), (8, 3, 128)):
                config = triton_kernel.TritonConfig(
                    num_warps=warps, num_stages=stages, block_kv=block_kv
                )
                variants.append(triton(f"triton w{warps} s{stages} bk{block_kv}", config, False))
        plan.append((LLAMA_3_8B, batch, variants, batch is not mixed))
    for batch in decodes + [mixed]:
        variants = [
            mosaic("mosaic", mosaic_gpu.KernelConfig(), False),
            triton("triton", forced, False),
        ]
        plan.append((GEMMA_2_9B, batch, variants, batch is not mixed))
    return plan


def head256_plan(smoke: bool, sweep: bool) -> list[tuple[Shape, Batch, list[Variant], bool]]:
    """(shape, batch, variants, with_reference) for ``--suite head256``: Triton configs at the
    Gemma-2-9B shape's decode cells, the default first."""
    if smoke:
        return tiers_plan(smoke, sweep)
    plan = []
    for batch in (decode_batch(1, 4096), decode_batch(64, 1024), decode_batch(64, 4096)):
        variants = [triton("triton", triton_kernel.TritonConfig(), False)]
        for warps, stages, block_kv in (
            (8, 2, 32), (4, 3, 32), (8, 3, 32), (4, 2, 64), (8, 2, 64), (8, 3, 64), (4, 4, 32)
        ):  # fmt: skip
            config = triton_kernel.TritonConfig(
                num_warps=warps, num_stages=stages, block_kv=block_kv
            )
            variants.append(triton(f"triton w{warps} s{stages} bk{block_kv}", config, False))
        plan.append((GEMMA_2_9B, batch, variants, False))
    return plan


def llama_plan(smoke: bool, sweep: bool) -> list[tuple[Shape, Batch, list[Variant], bool]]:
    """(shape, batch, variants, with_reference) for the default suite (the Mosaic kernel)."""
    base = mosaic_gpu.KernelConfig()
    if smoke:
        shape = Shape(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
        batches = [decode_batch(2, 40), mixed_batch(20, 2, 50)]
    else:
        shape = LLAMA_3_8B
        batches = [decode_batch(b, c) for c in (1024, 4096) for b in (1, 8, 64, 256)]
        batches += [mixed_batch(2048, 63, 4096), mixed_batch(2048, 63, 1024)]
    swept = {"decode b=8 ctx=4096", "decode b=64 ctx=4096", "mixed 2048+63x4096"}
    plan = []
    for batch in batches:
        variants = [mosaic("mosaic", base, smoke)]
        if sweep and batch.name in swept:
            variants += [
                mosaic("bk64 s3", dataclasses.replace(base, num_stages=3), smoke),
                mosaic("bk64 s4", dataclasses.replace(base, num_stages=4), smoke),
                mosaic("bk128 s2", dataclasses.replace(base, block_kv=128), smoke),
                mosaic("head-major kv", dataclasses.replace(base, head_major_kv=True), smoke),
            ]
        plan.append((shape, batch, variants, True))
    return plan


def sinks_plan(smoke: bool, sweep: bool) -> list[tuple[Shape, Batch, list[Variant], bool]]:
    """(shape, batch, variants, with_reference) for ``--suite sinks``: each case without and
    with sinks, on both GPU kernels."""
    del sweep  # no config variants here
    if smoke:
        base = Shape(num_q_heads=8, num_kv_heads=2, head_dim=64)
        batches, windows = [mixed_batch(20, 2, 50)], (16,)
    else:
        base = GPT_OSS_20B
        batches = [decode_batch(b, c) for c in (1024, 4096) for b in (1, 64, 256)]
        batches += [mixed_batch(2048, 63, 4096)]
        windows = (None, 128)
    variants = [
        mosaic("mosaic", mosaic_gpu.KernelConfig(), smoke),
        triton("triton", triton_kernel.TritonConfig(), smoke),
    ]
    plan = []
    for batch in batches:
        for window in windows:
            for has_sinks in (False, True):
                shape = dataclasses.replace(base, sliding_window=window, has_sinks=has_sinks)
                plan.append((shape, batch, variants, True))
    return plan


def fp8_plan(smoke: bool, sweep: bool) -> list[tuple[Shape, Batch, list[Variant], bool]]:
    """(shape, batch, variants, with_reference) for ``--suite fp8``: the bf16 kernel first (the
    errors' and the speed-ups' base), then the fp8 paths over the same pages quantized."""
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    base = mosaic_gpu.KernelConfig()
    native = dataclasses.replace(base, fp8_wgmma=True)
    if smoke:
        shape = Shape(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
        batches = [decode_batch(2, 40), mixed_batch(20, 2, 50)]
    else:
        shape = LLAMA_3_8B
        batches = [decode_batch(b, c) for c in (1024, 4096) for b in (1, 8, 64, 256)]
        batches += [mixed_batch(2048, 63, 4096), prompt_batch(1, 2048), prompt_batch(8, 256)]
    variants = [
        mosaic("bf16", base, smoke),
        mosaic("fp8 convert", base, smoke, kv_dtype=e4m3),
        mosaic("fp8 native", native, smoke, kv_dtype=e4m3),
    ]
    if sweep:
        for label, config in (
            ("s3", dataclasses.replace(native, num_stages=3)),
            ("s4", dataclasses.replace(native, num_stages=4)),
            ("bk128", dataclasses.replace(native, block_kv=128)),
            ("bk128 s3", dataclasses.replace(native, block_kv=128, num_stages=3)),
        ):
            variants.append(mosaic(f"fp8 native {label}", config, smoke, kv_dtype=e4m3))
        variants.append(mosaic("fp8 native e5m2", native, smoke, kv_dtype=e5m2))
    return [(shape, batch, variants, False) for batch in batches]


def issue_plan(smoke: bool, sweep: bool) -> list[tuple[Shape, Batch, list[Variant], bool]]:
    """(shape, batch, variants, with_reference) for ``--suite issue``: each kernel with a KV
    slot's next copies issued at the points of ``KernelConfig.issue_next`` ("read", "p",
    "end": the default) and with ``lean_registers`` (P.V in place; "lean"), over bf16 pages
    and fp8 pages (native: 64 and 128 tokens a step), at Llama-3-8B's decode cells; bf16 at
    Gemma-2-9B's head_dim 256 (whose default spilled: ``probes/kernel_registers.py``)."""
    del sweep  # the suite is its own sweep
    e4m3 = jnp.float8_e4m3fn
    base, native = mosaic_gpu.KernelConfig(), mosaic_gpu.KernelConfig(fp8_wgmma=True)
    bk128 = dataclasses.replace(native, block_kv=128)
    points = [("read", False), ("end", True), ("read", True)]  # beside the default ("end")
    configs = [  # (label, config, cache dtype, the points timed beside the default)
        ("bf16", base, None, points),
        ("fp8 native", native, e4m3, points),
        ("fp8 native bk128", bk128, e4m3, [*points, ("p", False), ("p", True)]),
    ]

    def variants_of(label, config, kv_dtype, timed) -> list[Variant]:
        out = [mosaic(f"{label} end", config, smoke, kv_dtype=kv_dtype)]
        for when, lean in timed:
            changed = dataclasses.replace(config, issue_next=when, lean_registers=lean)
            name = f"{label} {when}{' lean' if lean else ''}"
            out.append(mosaic(name, changed, smoke, kv_dtype=kv_dtype))
        return out

    if smoke:  # the orders in interpret mode (lean_registers runs natively only)
        shape = Shape(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
        timed = [("read", False), ("p", False)]
        return [(shape, decode_batch(1, 300), variants_of(*configs[2][:3], timed), False)]
    llama = [v for c in configs for v in variants_of(*c)]
    cells = [decode_batch(1, 4096), decode_batch(64, 4096), decode_batch(256, 1024)]
    plan = [(LLAMA_3_8B, batch, llama, False) for batch in cells]
    gemma = variants_of("bf16", base, None, points)
    plan += [(GEMMA_2_9B, decode_batch(64, 4096), gemma, False)]
    return plan


QWEN3_0_6B = Shape(num_q_heads=16, num_kv_heads=8, head_dim=128)


def prompts_plan(smoke: bool, sweep: bool) -> list[tuple[Shape, Batch, list[Variant], bool]]:
    """(shape, batch, variants, with_reference) for ``--suite prompts``: whole prompts, where
    attention is bound by compute (its TFLOP/s in ``prompts_table``): the embedding benchmark's
    64 x 256 at the Qwen3-0.6B shape, and Llama-3-8B prefill steps of 2,048 tokens."""
    base = mosaic_gpu.KernelConfig()
    if smoke:
        shape = Shape(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
        return [(shape, prompt_batch(2, 24), [mosaic("mosaic", base, True)], True)]
    cases = [(QWEN3_0_6B, prompt_batch(64, 256)), (QWEN3_0_6B, prompt_batch(16, 1024))]
    cases += [(LLAMA_3_8B, prompt_batch(1, 2048)), (LLAMA_3_8B, prompt_batch(8, 256))]
    variants = [mosaic("mosaic", base, False)]
    if sweep:
        for label, config in (
            ("bk64 s3", dataclasses.replace(base, num_stages=3)),
            ("bk128 s2", dataclasses.replace(base, block_kv=128)),
            ("bk128 s3", dataclasses.replace(base, block_kv=128, num_stages=3)),
        ):
            variants.append(mosaic(label, config, False))
        variants.append(triton("triton", triton_kernel.TritonConfig(), False))
    return [(shape, batch, variants, False) for shape, batch in cases]


def prompts_table(rows) -> str:
    """Each kernel's TFLOP/s over the causal pairs it computes, and its share of 989."""
    lines = [
        "| shape | case | kernel | device us | TFLOP/s | of 989 |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        seconds = r.get("seconds", r.get("wall_s"))
        if "error" in r or not seconds:
            continue
        tflops = r["flops"] / seconds / 1e12
        lines.append(
            f"| {r['shape']} | {r['case']} | {r['kernel']} | {seconds * 1e6:.1f} "
            f"| {tflops:.0f} | {tflops / 989:.0%} |"
        )
    return "\n".join(lines)


def fp8_table(rows) -> str:
    """Tokens/s of each kernel and its speed-up over the bf16 kernel in the same case."""
    lines = [
        "| case | kernel | device us | tokens/s | x bf16 |",
        "|---|---|---:|---:|---:|",
    ]
    bf16 = {r["case"]: r.get("seconds", r.get("wall_s")) for r in rows if r["kernel"] == "bf16"}
    for r in rows:
        seconds = r.get("seconds", r.get("wall_s"))
        if "error" in r or not seconds:
            continue
        base = bf16.get(r["case"])
        speedup = f"{base / seconds:.2f}" if base else "-"
        lines.append(
            f"| {r['case']} | {r['kernel']} | {seconds * 1e6:.1f} "
            f"| {r['num_tokens'] / seconds:,.0f} | {speedup} |"
        )
    return "\n".join(lines)


def fp8_target_line(rows) -> str | None:
    """The native path's target at batch 64 x 4096, Llama-3-8B shape: >= 1.6x the bf16 kernel."""
    cell = {
        r["kernel"]: r.get("seconds", r.get("wall_s"))
        for r in rows
        if r["case"] == "decode b=64 ctx=4096" and r["shape"] == "32/8x128" and "error" not in r
    }
    if not cell.get("bf16") or not cell.get("fp8 native"):
        return None
    native = cell["bf16"] / cell["fp8 native"]
    convert = f"{cell['bf16'] / cell['fp8 convert']:.2f}x" if cell.get("fp8 convert") else "-"
    verdict = "met" if native >= 1.6 else "NOT met"
    return (
        f"fp8 native at decode b=64 ctx=4096: {native:.2f}x the bf16 kernel (target >= 1.6x: "
        f"{verdict}); fp8 convert: {convert}"
    )


def triton_target_line(rows) -> str | None:
    """The tier's target at batch 64 x 4096, Llama-3-8B shape: >= 40% of the KV-read floor."""
    for r in rows:
        if r["kernel"] == "triton" and r["case"] == "decode b=64 ctx=4096" and "floor_frac" in r:
            if r["shape"] == "32/8x128":
                verdict = "met" if r["floor_frac"] >= 0.40 else "NOT met"
                return (
                    f"Triton tier at decode b=64 ctx=4096: {r['floor_frac']:.0%} of the floor "
                    f"(target >= 40%: {verdict})"
                )
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    parser.add_argument(
        "--suite",
        choices=("llama", "tiers", "head256", "sinks", "fp8", "prompts", "issue"),
        default="llama",
    )
    parser.add_argument("--sweep", action="store_true", help="also time config variants")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--only", default="", help="comma-separated case names to run")
    parser.add_argument(
        "--head-dims", default="", help="comma-separated head sizes to run (default: every case's)"
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=None,
        help="each case as a served step: a page table of SLOTS rows (--max-num-seqs), its "
        "tokens padded to the step's bucket; the KV splits are planned as the runner's are",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=8192, help="with --slots: the page table's positions"
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="KV tokens a page in every case (the served --block-size; default: each case's, 16)",
    )
    args = parser.parse_args(argv)

    # The Pallas Triton backend warns, once per lowering, that it is deprecated (jax 0.11).
    warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
    rng = np.random.default_rng()
    reps, pool = (1, 1 << 20) if args.smoke else (args.reps, args.pool_mib << 20)
    plan_for = {
        "llama": llama_plan,
        "tiers": tiers_plan,
        "head256": head256_plan,
        "sinks": sinks_plan,
        "fp8": fp8_plan,
        "prompts": prompts_plan,
        "issue": issue_plan,
    }[args.suite]
    plan = plan_for(args.smoke, args.sweep)
    if args.only:
        plan = [p for p in plan if p[1].name in args.only.split(",")]
    if args.head_dims:
        plan = [p for p in plan if str(p[0].head_dim) in args.head_dims.split(",")]
    if args.page_size is not None:
        plan = [(dataclasses.replace(p[0], page_size=args.page_size), *p[1:]) for p in plan]
    served = None if args.slots is None else Served(args.slots, args.max_model_len)
    rows = []
    for shape, batch, variants, with_reference in plan:
        new = run_case(
            rng, shape, batch, variants=variants, reps=reps, pool_bytes=pool,
            with_reference=with_reference, served=served,
        )  # fmt: skip
        rows += new
        print("\n".join(format_table(new).splitlines()[2:]), flush=True)
        if args.out:  # the rows so far, kept if the call is cut off before the end
            with open(args.out, "w") as f:
                json.dump(dict(rows=rows, partial=True), f, indent=1)
    device = jax.devices()[0]
    rate = None if args.smoke else copy_rate()
    header = (
        f"{datetime.date.today()} | {getattr(device, 'device_kind', device.platform)}"
        f" | jax {jax.__version__}"
        + (f" | 1 GiB copy: {rate / 1e12:.2f} TB/s (read + write)" if rate else "")
    )
    table = format_table(rows)
    print(header)
    print(table)
    extra = {}
    if args.suite == "fp8":
        extra = dict(fp8_table=fp8_table(rows), fp8_target=fp8_target_line(rows))
        print(extra["fp8_table"])
    if args.suite == "prompts":
        extra = dict(prompts_table=prompts_table(rows))
        print(extra["prompts_table"])
    target = triton_target_line(rows) or extra.get("fp8_target")
    if target:
        print(target)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(header=header, rows=rows, table=table, **extra), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
