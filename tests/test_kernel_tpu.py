"""The Mosaic TPU attention kernel against the reference, in TPU interpret mode on the CPU.

The interpreter simulates HBM, VMEM, DMAs and DMA semaphores: copies land only when waited on,
fresh VMEM reads as NaN, and the parallel grid axis is visited in a random order, so a missing
wait, a read of an unfetched page or a dependence between query blocks shows up as a mismatch;
its race detector also checks every run for a read or write that races a DMA. Nothing here
compiles the kernel with Mosaic or runs it on a TPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# NOTE: the race detector's verdict is only exposed on this private module.
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import reference, tpu

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]  # query rows per live sequence
    kv_lens: tuple[int, ...]  # cached tokens per live sequence, the new ones included
    page_size: int = 4
    num_kv_heads: int = 2
    group: int = 1  # query heads per KV head
    head_dim: int = 64
    dtype: type = jnp.float32
    num_padding_rows: int = 3
    num_padding_seqs: int = 1
    sliding_window: int | None = None
    soft_cap: float | None = None
    tokens_per_block: int = 8
    pages_per_block: int = 2
    kv_dtype: Any = None  # an fp8 cache: k / k_scale and v / v_scale stored in this dtype
    k_scale: float = 0.02
    v_scale: float = 0.03
    has_sinks: bool = False  # attention sinks (GPT-OSS): a fresh logit per query head


def make_inputs(case: Case, seed: int) -> tuple[jax.Array, ...]:
    """Fresh random q/k/v, a shuffled page table and padded ragged metadata for `case`."""
    rng = np.random.default_rng(seed)
    num_live = len(case.q_lens)
    num_slots = num_live + case.num_padding_seqs
    pages_per_seq = -(-max(case.kv_lens) // case.page_size) + 1
    num_pages = num_slots * pages_per_seq + 3
    num_tokens = sum(case.q_lens) + case.num_padding_rows
    num_q_heads = case.num_kv_heads * case.group

    page_indices = rng.permutation(num_pages)[: num_slots * pages_per_seq]
    page_indices = page_indices.reshape(num_slots, pages_per_seq).astype(np.int32)
    # Padding slots carry arbitrary lengths: the kernel must ignore everything past num_seqs.
    kv_lens = rng.integers(0, pages_per_seq * case.page_size, num_slots).astype(np.int32)
    kv_lens[:num_live] = case.kv_lens
    cu_q_lens = np.full(num_slots + 1, sum(case.q_lens), np.int32)
    cu_q_lens[: num_live + 1] = np.concatenate([[0], np.cumsum(case.q_lens)])

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), case.dtype)

    kv_shape = (num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    q = normal(num_tokens, num_q_heads, case.head_dim)  # [T, Hq, D]
    k_pages = normal(*kv_shape)  # [P, page_size, Hkv, D]
    v_pages = normal(*kv_shape)
    if case.kv_dtype is not None:
        k_pages = kv_cache.quantize_kv(k_pages, case.kv_dtype, case.k_scale)
        v_pages = kv_cache.quantize_kv(v_pages, case.kv_dtype, case.v_scale)
    return (
        q,
        k_pages,
        v_pages,
        jnp.asarray(kv_lens),  # i32[S]
        jnp.asarray(page_indices),  # i32[S, pages_per_seq]
        jnp.asarray(cu_q_lens),  # i32[S + 1]
        jnp.asarray([num_live], jnp.int32),  # i32[1]
    )


def check_against_reference(case: Case, seed: int) -> None:
    inputs = make_inputs(case, seed)
    options = dict(
        sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap
    )
    if case.kv_dtype is not None:
        options.update(k_scale=case.k_scale, v_scale=case.v_scale)
    if case.has_sinks:
        num_q_heads = case.num_kv_heads * case.group
        sinks = np.random.default_rng(seed + 1).normal(0.5, 2.0, num_q_heads)
        options.update(sinks=jnp.asarray(sinks, jnp.float32))
    expected = reference.ragged_paged_attention(*inputs, **options)
    params = pltpu.InterpretParams(random_seed=seed, detect_races=True)
    with pltpu.force_tpu_interpret_mode(params):
        got = tpu.ragged_paged_attention(
            *inputs,
            **options,
            num_q_tokens_per_block=case.tokens_per_block,
            num_kv_pages_per_block=case.pages_per_block,
        )
        got = jax.block_until_ready(got)
    assert mosaic_interpret.races is not None and not mosaic_interpret.races.races_found

    assert got.shape == inputs[0].shape and got.dtype == case.dtype
    got32 = np.asarray(got.astype(jnp.float32))
    tol = TOLERANCE[case.dtype]
    expected32 = np.asarray(expected.astype(jnp.float32))
    np.testing.assert_allclose(got32, expected32, atol=tol, rtol=tol, err_msg=f"seed {seed}")
    assert not np.any(got32[sum(case.q_lens) :]), "padding rows must be zero"


CASES = {
    # One decode token per sequence; KV lengths 1, page-1, page, page+1, a few pages.
    "decode": Case(q_lens=(1, 1, 1, 1, 1), kv_lens=(1, 3, 4, 5, 11), head_dim=128),
    # Whole prompt, decode, chunked prefill over several KV blocks, decode: in one call, with
    # sequences straddling query blocks.
    "mixed_gqa2_bf16": Case(
        q_lens=(5, 1, 9, 1), kv_lens=(5, 4, 17, 8), group=2, dtype=jnp.bfloat16
    ),
    "prefill_gqa4": Case(q_lens=(12, 3), kv_lens=(12, 21), num_kv_heads=1, group=4),
    # A live sequence with no query rows this step takes no part.
    "window_softcap": Case(
        q_lens=(6, 0, 1, 7), kv_lens=(13, 5, 9, 7), group=2, sliding_window=5, soft_cap=2.0
    ),
    "window_bf16_d128": Case(
        q_lens=(1, 10), kv_lens=(16, 18), head_dim=128, dtype=jnp.bfloat16, sliding_window=3
    ),
    # fp8 caches: fetched as stored, cast to the queries' dtype in VMEM, scales on f32 results.
    "fp8_e4m3_mixed_bf16": Case(
        q_lens=(5, 1, 9, 1),
        kv_lens=(5, 4, 17, 8),
        group=2,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.float8_e4m3fn,
    ),
    "fp8_e5m2_window_f32": Case(
        q_lens=(6, 1),
        kv_lens=(13, 9),
        sliding_window=5,
        soft_cap=2.0,
        kv_dtype=jnp.float8_e5m2,
        k_scale=0.5,
        v_scale=2.0,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference(name: str) -> None:
    check_against_reference(CASES[name], seed=len(name))


# Attention sinks (GPT-OSS): GQA, mixed rows, a sliding window; the running max starts at each
# row's sink, in every query block.
SINK_CASES = {
    "sinks_mixed_gqa4": Case(q_lens=(5, 1, 9, 1), kv_lens=(5, 4, 17, 8), group=4, has_sinks=True),
    "sinks_window_gqa2_bf16": Case(
        q_lens=(6, 0, 1, 7),
        kv_lens=(13, 5, 9, 7),
        group=2,
        dtype=jnp.bfloat16,
        sliding_window=5,
        has_sinks=True,
    ),
}


@pytest.mark.parametrize("name", SINK_CASES)
def test_kernel_with_sinks_matches_reference(name: str) -> None:
    check_against_reference(SINK_CASES[name], seed=int(np.random.default_rng().integers(2**31)))


def test_kernel_matches_reference_with_default_blocks() -> None:
    # One query block covers the whole batch; fetches still alternate slots across sequences.
    case = dataclasses.replace(
        CASES["mixed_gqa2_bf16"], dtype=jnp.float32, tokens_per_block=32, pages_per_block=8
    )
    check_against_reference(case, seed=7)


def test_kernel_rejects_mismatched_head_dim() -> None:
    q, k_pages, v_pages, *metadata = make_inputs(Case(q_lens=(1,), kv_lens=(3,)), seed=0)
    with pytest.raises(ValueError, match="head_dim"):
        tpu.ragged_paged_attention(q[..., :32], k_pages, v_pages, *metadata, sm_scale=1.0)
