"""The Mosaic GPU ragged paged attention kernel against the pure-jnp reference.

On CPU (CI) the kernel runs in Mosaic GPU interpret mode on tiny shapes. The ``gpu`` tests run it
natively on a Hopper GPU over the same grid plus larger shapes, with the outputs poisoned before
each run. Every case draws fresh random inputs and a shuffled page table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import dispatch, mosaic_gpu, reference


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]  # query tokens per live sequence
    kv_lens: tuple[int, ...]  # cached tokens per live sequence, new ones included
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    num_pad_tokens: int = 0  # rows past the last sequence: must come back as zeros
    num_dead_slots: int = 0  # page-table rows past num_seqs: must be ignored
    num_splits: int | None = None
    sliding_window: int | None = None
    soft_cap: float | None = None
    head_major_kv: bool = False
    dtype: str = "bfloat16"
    kv_dtype: Any = None  # an fp8 cache: k / k_scale and v / v_scale stored in this dtype
    k_scale: float = 0.02  # |k| < ~6: within e4m3's 448 after the scale
    v_scale: float = 0.03
    has_sinks: bool = False  # attention sinks (GPT-OSS): fresh logits from ``make_sinks``


def make_inputs(rng: np.random.Generator, case: Case):
    """Random q/k/v (case.dtype; the cache quantized to ``case.kv_dtype`` when set) and a
    shuffled page table; unused table entries point at live pages."""
    page = case.page_size
    num_live = len(case.q_lens)
    num_slots = num_live + case.num_dead_slots
    seq_pages = [-(-kv // page) for kv in case.kv_lens]
    pages_per_seq = max(seq_pages) + 1
    num_pages = sum(seq_pages) + 3
    order = rng.permutation(num_pages)
    page_indices = rng.integers(0, num_pages, (num_slots, pages_per_seq)).astype(np.int32)
    first = 0
    for i, n in enumerate(seq_pages):
        page_indices[i, :n] = order[first : first + n]
        first += n
    cu_q_lens = np.zeros(num_slots + 1, np.int32)  # i32[S + 1]
    cu_q_lens[1 : num_live + 1] = np.cumsum(case.q_lens)
    cu_q_lens[num_live + 1 :] = cu_q_lens[num_live]
    kv_lens = np.zeros(num_slots, np.int32)  # i32[S]
    kv_lens[:num_live] = case.kv_lens
    kv_lens[num_live:] = rng.integers(1, page * pages_per_seq, case.num_dead_slots)
    num_tokens = sum(case.q_lens) + case.num_pad_tokens
    kv_shape = (num_pages, page, case.num_kv_heads, case.head_dim)
    q = rng.standard_normal((num_tokens, case.num_q_heads, case.head_dim))  # [T, Hq, D]
    k = rng.standard_normal(kv_shape)  # [P, page_size, Hkv, D]
    v = rng.standard_normal(kv_shape)
    dtype = jnp.dtype(case.dtype)
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    if case.kv_dtype is not None:
        k = kv_cache.quantize_kv(k, case.kv_dtype, case.k_scale)
        v = kv_cache.quantize_kv(v, case.kv_dtype, case.v_scale)
    return (
        jnp.asarray(q, dtype),
        k,
        v,
        jnp.asarray(kv_lens),
        jnp.asarray(page_indices),
        jnp.asarray(cu_q_lens),
        jnp.asarray([num_live], jnp.int32),
    )


def make_sinks(rng: np.random.Generator, case: Case) -> dict:
    """``{"sinks": f32[Hq]}`` for a case with sinks, else ``{}``: logits around the scores'
    range (N(0, 1) at sm_scale), so that a row's sink takes anything from little to most of it."""
    if not case.has_sinks:
        return {}
    return dict(sinks=jnp.asarray(rng.normal(0.5, 2.0, case.num_q_heads), jnp.float32))


def attention_kwargs(case: Case) -> dict:
    scales = {} if case.kv_dtype is None else dict(k_scale=case.k_scale, v_scale=case.v_scale)
    return dict(
        sm_scale=case.head_dim**-0.5,
        sliding_window=case.sliding_window,
        soft_cap=case.soft_cap,
        **scales,
    )


def kernel_call(
    case: Case,
    *,
    interpret: bool | plgpu.InterpretGPUParams,
    issue_next: str = "end",
    lean_registers: bool = False,
):
    config = mosaic_gpu.KernelConfig(
        num_splits=case.num_splits,
        head_major_kv=case.head_major_kv,
        issue_next=issue_next,
        lean_registers=lean_registers,
    )

    def call(q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, **sinks):
        if case.head_major_kv:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return mosaic_gpu.ragged_paged_attention(
            q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs,
            **attention_kwargs(case), **sinks, config=config, interpret=interpret,
        )  # fmt: skip

    return call


def assert_matches(case: Case, out: jax.Array, ref: jax.Array, seed: int = -1) -> None:
    """bf16 tolerance on the live rows, exact zeros on the padding rows, never NaN."""
    what = f"{case.name} (seed {seed})"
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    num_live = sum(case.q_lens)
    np.testing.assert_array_equal(out[num_live:], 0.0, err_msg=f"{what}: padding rows")
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < 1e-2, f"{what}: relative error {rel:.2e}"
    np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2, err_msg=what)


# Tiny shapes: interpret mode simulates every program and copy on the CPU.
CPU_CASES = [
    # Prefill chunks over cached pages next to decodes: kv lengths 1, page, page+1, longer.
    Case("mixed_g4_d128", (1, 17, 1, 5), (1, 40, 16, 21), 4, 1, 128, num_pad_tokens=3,
         num_dead_slots=1),
    Case("decode_g1_d64", (1, 1, 1), (15, 16, 17), 2, 2, 64, num_pad_tokens=2),
    Case("split_g8_d64", (1, 9, 1), (70, 9, 100), 8, 1, 64, num_splits=2, num_dead_slots=1),
    Case("g3_page32", (3, 1), (33, 31), 6, 2, 64, page_size=32, num_pad_tokens=1),
    Case("page128_g2", (1, 2), (200, 129), 4, 2, 64, page_size=128),
    Case("window_softcap", (20, 1), (90, 75), 4, 2, 64, sliding_window=24, soft_cap=30.0,
         num_splits=2),
    # fp8 caches: converted to bf16 in shared memory, scales on the f32 scores and output.
    Case("fp8_e4m3_mixed", (1, 17, 1, 5), (1, 40, 16, 21), 4, 1, 128, num_pad_tokens=3,
         kv_dtype=jnp.float8_e4m3fn),
    Case("fp8_e5m2_split_window", (9, 1), (70, 100), 8, 2, 64, num_splits=2, sliding_window=40,
         soft_cap=30.0, kv_dtype=jnp.float8_e5m2, k_scale=0.5, v_scale=2.0),
    # The other head sizes (smem swizzle 64 for 96; 256 in column chunks) and fp16.
    Case("d96_fp16", (1, 9), (20, 40), 4, 2, 96, num_pad_tokens=1, dtype="float16"),
    Case("d96_split", (1, 9), (20, 40), 4, 2, 96, num_splits=2),
    Case("d256_gemma", (9, 1), (40, 20), 2, 1, 256, sliding_window=16, soft_cap=30.0,
         num_pad_tokens=2),
    # Attention sinks (GPT-OSS: head_dim 64, GQA 8, sliding window): unsplit, the kernel starts
    # each row from its head's sink; split, the merge adds it once.
    Case("sinks_mixed_g8", (1, 17, 1, 5), (1, 40, 16, 21), 16, 2, 64, num_pad_tokens=3,
         num_dead_slots=1, num_splits=1, has_sinks=True),
    Case("sinks_window_g3", (9, 1), (40, 20), 6, 2, 64, sliding_window=16, num_splits=1,
         has_sinks=True),
    Case("sinks_split2_window_g4", (20, 1), (90, 75), 8, 2, 64, sliding_window=24, num_splits=2,
         num_pad_tokens=2, has_sinks=True),
    Case("sinks_fp8_e4m3_g4", (1, 9), (20, 40), 8, 2, 64, num_splits=1, has_sinks=True,
         kv_dtype=jnp.float8_e4m3fn),
]  # fmt: skip


@pytest.mark.parametrize(
    ("head_dim", "dtype", "num_splits"),
    [(64, "bfloat16", 1), (96, "float16", 2), (96, "bfloat16", 1), (128, "float16", 2),
     (256, "bfloat16", 1), (256, "float16", 2)],
)  # fmt: skip
def test_lowers_for_cuda(head_dim: int, dtype: str, num_splits: int):
    """The full Mosaic GPU lowering (layout inference, wgmma and TMA checks) runs on the CPU."""
    case = Case("lower", (1, 9), (20, 40), 4, 2, head_dim, dtype=dtype, num_splits=num_splits)
    args = make_inputs(np.random.default_rng(0), case)
    lowered = jax.jit(kernel_call(case, interpret=False)).trace(*args)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    ("head_dim", "kv_dtype", "num_splits"),
    [(128, None, 1), (256, None, 2), (128, jnp.float8_e4m3fn, 1)],
)  # fmt: skip
def test_lean_register_forms_lower_for_cuda(head_dim: int, kv_dtype, num_splits: int):
    """``lean_registers`` (P.V in place through run_state, which the interpreter lacks; QK^T
    looped at head_dim 256) goes through the full lowering for CUDA; the gpu tests run it."""
    case = Case("lower", (1, 9), (200, 40), 4, 2, head_dim, num_splits=num_splits,
                kv_dtype=kv_dtype)  # fmt: skip
    args = make_inputs(np.random.default_rng(0), case)
    call = kernel_call(case, interpret=False, lean_registers=True)
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("case", [c for c in CPU_CASES if c.has_sinks], ids=lambda c: c.name)
def test_sinks_kernel_lowers_for_cuda(case: Case):
    """The sinks' start of the online softmax (unsplit) lowers for the GPU like the rest."""
    rng = np.random.default_rng(0)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    call = kernel_call(case, interpret=False)
    lowered = jax.jit(lambda *a: call(*a, **sinks)).trace(*args)
    assert "mosaic_gpu" in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_shared_memory_over_the_limit_is_refused():
    case = Case("smem", (1,), (20,), 2, 1, 256)
    args = make_inputs(np.random.default_rng(0), case)
    config = mosaic_gpu.KernelConfig(block_kv=128, num_stages=2)
    with pytest.raises(ValueError, match=r"head_dim=256 with block_kv=128 .* the limit is 232,448"):
        mosaic_gpu.ragged_paged_attention(
            *args, **attention_kwargs(case), config=config, interpret=True
        )
    assert mosaic_gpu.smem_bytes(256, 2, 64, 2) <= mosaic_gpu.SMEM_BYTES  # the default fits


@pytest.mark.parametrize(
    ("dtype", "head_dim", "why"),
    [("float32", 128, "bfloat16 or float16"), ("bfloat16", 112, "head_dim=112"),
     ("bfloat16", 48, "head_dim=48")],
)  # fmt: skip
def test_unsupported_reason_names_the_field(dtype: str, head_dim: int, why: str):
    q = jax.ShapeDtypeStruct((1, 8, head_dim), jnp.dtype(dtype))
    k_pages = jax.ShapeDtypeStruct((1, 16, 2, head_dim), jnp.dtype(dtype))
    reason = mosaic_gpu.unsupported_reason(q, k_pages)
    assert reason is not None and why in reason


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case, capfd):
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    rng = np.random.default_rng(seed)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    # The race detector also checks the TMA / wgmma / shared-memory ordering and that each
    # RefUnion member is read only through the ref that wrote it.
    out = kernel_call(case, interpret=plgpu.InterpretGPUParams(detect_races=True))(*args, **sinks)
    ref = reference.ragged_paged_attention(*args, **attention_kwargs(case), **sinks)
    assert_matches(case, out, ref, seed)
    assert "RACE DETECTED" not in capfd.readouterr().out


def test_plan_tiles_covers_every_row_once():
    cu_q_lens = jnp.asarray([0, 1, 18, 18, 23, 23], jnp.int32)  # a zero-length sequence inside
    kv_lens = jnp.asarray([5, 40, 3, 21, 9], jnp.int32)
    num_seqs = jnp.asarray([4], jnp.int32)
    plan = mosaic_gpu.plan_tiles(
        cu_q_lens, kv_lens, num_seqs, num_tokens=30, block_q=8, max_tiles=10, with_padding=True
    )
    seq, first, size, pos0, kv = np.asarray(plan)
    covered = np.zeros(30, np.int32)
    for t in range(10):
        covered[first[t] : first[t] + size[t]] += 1
    np.testing.assert_array_equal(covered, 1)
    # Sequence 1 (17 rows at kv 40): tiles of 8, 8, 1 rows starting at absolute position 23.
    live = size > 0
    np.testing.assert_array_equal(size[live], [1, 8, 8, 1, 5, 7])
    np.testing.assert_array_equal(pos0[live][:4], [4, 23, 31, 39])
    np.testing.assert_array_equal(kv[live], [5, 40, 40, 40, 21, 0])


def test_entry_point_on_cpu_is_the_reference():
    case = CPU_CASES[0]
    args = make_inputs(np.random.default_rng(1), case)
    out = dispatch.ragged_paged_attention(*args, **attention_kwargs(case))
    ref = reference.ragged_paged_attention(*args, **attention_kwargs(case))
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    else:
        assert_matches(case, out, ref)


def _is_hopper() -> bool:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    return int(str(getattr(device, "compute_capability", "0")).split(".")[0]) >= 9


def _gpu_cases() -> list[Case]:
    rng = np.random.default_rng(7)
    ragged = tuple(int(x) for x in rng.integers(1, 3000, 24))
    return CPU_CASES + [
        Case("llama_decode_ragged", (1,) * 24, ragged, 32, 8, 128, num_pad_tokens=5,
             num_dead_slots=3),
        Case("llama_decode_split4", (1,) * 6, ragged[:6], 32, 8, 128, num_splits=4),
        Case("llama_mixed", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 32, 8, 128,
             num_pad_tokens=11),
        Case("llama_mixed_split3", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 32, 8, 128,
             num_splits=3),
        Case("g1_d128_page32", (1, 40, 1), (1000, 40, 33), 8, 8, 128, page_size=32),
        Case("g5_d64_page64", (65, 1, 33), (130, 513, 100), 10, 2, 64, page_size=64,
             num_pad_tokens=4),
        Case("g7_d128_page128", (9, 1, 130), (9, 1000, 258), 7, 1, 128, page_size=128),
        Case("window_softcap_llama", (200, 1, 1), (1200, 700, 33), 32, 8, 128,
             sliding_window=128, soft_cap=50.0),
        Case("head_major_kv", (1, 30, 1), (900, 60, 17), 32, 8, 128, head_major_kv=True),
        Case("fp8_llama_decode_ragged", (1,) * 24, ragged, 32, 8, 128, num_pad_tokens=5,
             kv_dtype=jnp.float8_e4m3fn),
        Case("fp8_llama_mixed_split3", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 32, 8, 128,
             num_splits=3, kv_dtype=jnp.float8_e4m3fn),
        # Gemma-2-9B (16/8 heads, 256, window 4096, soft cap 50), Phi-3 (32/32, 96), fp16.
        Case("gemma2_d256_mixed", (300, 1, 1, 77, 1), (300, 5000, 17, 500, 64), 16, 8, 256,
             num_pad_tokens=7, sliding_window=4096, soft_cap=50.0),
        Case("gemma2_d256_decode_split", (1,) * 6, ragged[:6], 16, 8, 256, num_splits=4),
        Case("phi3_d96", (200, 1, 1), (1200, 700, 33), 32, 32, 96, sliding_window=512),
        Case("d96_fp16_llama", (1,) * 24, ragged, 32, 8, 96, dtype="float16", num_pad_tokens=3),
        Case("fp16_mixed", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 32, 8, 128,
             dtype="float16"),
        *GPT_OSS_SINK_CASES,
        Case("fp8_gpt_oss_mixed_window_sinks", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64),
             64, 8, 64, sliding_window=128, kv_dtype=jnp.float8_e4m3fn, has_sinks=True),
    ]  # fmt: skip


# gpt-oss-20b's attention (64 query heads over 8 KV heads, head_dim 64, sinks, every other layer
# a 128-token window), for both GPU kernels' native tests.
_RAGGED = tuple(int(x) for x in np.random.default_rng(7).integers(1, 3000, 24))
GPT_OSS_SINK_CASES = [
    Case("gpt_oss_decode_ragged_sinks", (1,) * 24, _RAGGED, 64, 8, 64, num_pad_tokens=5,
         num_dead_slots=3, has_sinks=True),
    Case("gpt_oss_decode_split4_window_sinks", (1,) * 6, _RAGGED[:6], 64, 8, 64, num_splits=4,
         sliding_window=128, has_sinks=True),
    Case("gpt_oss_mixed_window_sinks", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 64, 8, 64,
         sliding_window=128, num_pad_tokens=11, has_sinks=True),
    Case("gpt_oss_mixed_split3_sinks", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 64, 8, 64,
         num_splits=3, has_sinks=True),
]  # fmt: skip


def _poisoned_run(fn, args, out_shape, dtype):
    """Run fn(*args) with NaN left in the allocator and a NaN donor aliased to the output."""
    scrub = jnp.full((1 << 26,), jnp.nan, jnp.float32)  # 256 MiB of NaN, freed for reuse
    scrub.block_until_ready()
    del scrub
    donor = jnp.full(out_shape, jnp.nan, dtype)
    return jax.jit(lambda donor, *a: fn(*a), donate_argnums=0)(donor, *args)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90+) NVIDIA GPU")
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c.name)
def test_native_matches_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    kwargs = attention_kwargs(case)
    ref = jax.jit(lambda *a, **s: reference.ragged_paged_attention(*a, **kwargs, **s))(
        *args, **sinks
    )
    call = kernel_call(case, interpret=False)
    out = _poisoned_run(lambda *a: call(*a, **sinks), args, ref.shape, ref.dtype)
    assert_matches(case, out, ref, seed)


# A slot's next copies issued before the softmax ("read") or after P ("p"): bf16 pages (V's
# copy after P.V), an fp8 cache converted (V read into its bf16 tile), split and unsplit, a
# window, head_dim 256 (two column chunks) and pages of 128 tokens.
ISSUE_CASES = (
    "gemma2_d256_decode_split",
    "llama_decode_ragged",
    "llama_mixed_split3",
    "fp8_llama_decode_ragged",
    "fp8_llama_mixed_split3",
    "window_softcap_llama",
    "gemma2_d256_mixed",
    "g7_d128_page128",
)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90+) NVIDIA GPU")
@pytest.mark.parametrize(("when", "lean"), [("read", False), ("p", False), ("end", True),
                                            ("read", True)])  # fmt: skip
@pytest.mark.parametrize("name", ISSUE_CASES)
def test_native_copies_issued_earlier_match_reference(name: str, when: str, lean: bool):
    """Each order of a slot's copies, and the lean register forms (P.V in place, QK^T looped
    at head_dim 256), natively: the interpreter has no run_state."""
    case = next(c for c in _gpu_cases() if c.name == name)
    seed = int(np.random.default_rng().integers(2**31))
    args = make_inputs(np.random.default_rng(seed), case)
    kwargs = attention_kwargs(case)
    ref = jax.jit(lambda *a: reference.ragged_paged_attention(*a, **kwargs))(*args)
    call = kernel_call(case, interpret=False, issue_next=when, lean_registers=lean)
    out = _poisoned_run(call, args, ref.shape, ref.dtype)
    assert_matches(case, out, ref, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90+) NVIDIA GPU")
def test_entry_point_on_hopper_runs_the_kernel():
    case = CPU_CASES[0]
    args = make_inputs(np.random.default_rng(), case)
    jaxpr = jax.make_jaxpr(
        lambda *a: dispatch.ragged_paged_attention(*a, **attention_kwargs(case))
    )(*args)
    assert "kernel_name='ragged_paged_attention'" in str(jaxpr)  # the Mosaic GPU kernel ran
    out = dispatch.ragged_paged_attention(*args, **attention_kwargs(case))
    assert_matches(case, out, reference.ragged_paged_attention(*args, **attention_kwargs(case)))


def test_kernel_takes_bf16_or_fp16_queries_over_their_dtype_or_fp8_caches():
    for q_dtype in (jnp.bfloat16, jnp.float16):
        q = jax.ShapeDtypeStruct((1, 8, 128), q_dtype)
        for dtype in (q_dtype, jnp.float8_e4m3fn, jnp.float8_e5m2):
            k_pages = jax.ShapeDtypeStruct((4, 16, 2, 128), dtype)
            assert mosaic_gpu.unsupported_reason(q, k_pages) is None
    q = jax.ShapeDtypeStruct((1, 8, 128), jnp.bfloat16)
    k16 = jax.ShapeDtypeStruct((4, 16, 2, 128), jnp.float16)
    assert "queries' dtype or fp8" in mosaic_gpu.unsupported_reason(q, k16)
    q8 = jax.ShapeDtypeStruct((1, 8, 128), jnp.float8_e4m3fn)
    k8 = jax.ShapeDtypeStruct((4, 16, 2, 128), jnp.float8_e4m3fn)
    assert "bfloat16 or float16 queries" in mosaic_gpu.unsupported_reason(q8, k8)
    q256 = jax.ShapeDtypeStruct((1, 8, 256), jnp.bfloat16)
    k256 = jax.ShapeDtypeStruct((4, 16, 2, 256), jnp.float8_e4m3fn)
    assert "fp8 cache" in mosaic_gpu.unsupported_reason(q256, k256)


@pytest.mark.parametrize(
    "case", [c for c in CPU_CASES if c.kv_dtype is not None], ids=lambda c: c.name
)
def test_fp8_kernel_lowers_for_cuda(case: Case):
    """Cross-platform lowering on the CPU runs Mosaic GPU's layout inference and register
    lowering (not ptxas): the fp8 -> bf16 conversion of the K and V tiles is in the module."""
    args = make_inputs(np.random.default_rng(0), case)
    config = mosaic_gpu.KernelConfig(num_splits=case.num_splits)
    fn = jax.jit(
        lambda *a: mosaic_gpu.ragged_paged_attention(*a, **attention_kwargs(case), config=config)
    )
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    conversion = "e4m3x2" if case.kv_dtype == jnp.float8_e4m3fn else "e5m2x2"
    assert f"cvt.rn.f16x2.{conversion}" in text


def numpy_attention_with_sinks(args, case: Case, sinks: np.ndarray) -> np.ndarray:
    """Each live row's softmax over its visible keys plus one sink column per head, the sink
    then dropped (Hugging Face's GptOss eager attention), in float64; padding rows zero."""
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = (
        np.asarray(a, np.float64) if i < 3 else np.asarray(a) for i, a in enumerate(args)
    )
    out = np.zeros(q.shape)
    group = case.num_q_heads // case.num_kv_heads
    for s in range(int(num_seqs[0])):
        kv_len = int(kv_lens[s])
        keys = k_pages[page_indices[s]].reshape(-1, case.num_kv_heads, case.head_dim)[:kv_len]
        values = v_pages[page_indices[s]].reshape(-1, case.num_kv_heads, case.head_dim)[:kv_len]
        start, end = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        for row in range(start, end):
            pos = kv_len - (end - start) + (row - start)
            first = 0 if case.sliding_window is None else max(0, pos - case.sliding_window + 1)
            for h in range(case.num_q_heads):
                kv_head = h // group
                scores = keys[first : pos + 1, kv_head] @ q[row, h] * case.head_dim**-0.5
                m = max(scores.max(), sinks[h])
                e = np.exp(scores - m)
                p = e / (e.sum() + np.exp(sinks[h] - m))
                out[row, h] = p @ values[first : pos + 1, kv_head]
    return out


@pytest.mark.parametrize("name", ["mixed_g4_d128", "g3_page32"])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_sinks_are_a_softmax_with_one_more_column(name: str, window: int | None):
    """Attention sinks (GPT-OSS): each head's sink logit joins every row's denominator."""
    case = dataclasses.replace(
        next(c for c in CPU_CASES if c.name == name), dtype="float32", sliding_window=window
    )
    args = make_inputs(np.random.default_rng(3), case)
    sinks = np.random.default_rng(4).normal(0, 2.0, case.num_q_heads)
    kwargs = dict(sm_scale=case.head_dim**-0.5, sliding_window=window)
    got = reference.ragged_paged_attention(*args, **kwargs, sinks=jnp.asarray(sinks, jnp.float32))
    want = numpy_attention_with_sinks(args, case, sinks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    plain = reference.ragged_paged_attention(*args, **kwargs)
    assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the sinks change the output
    # A sink far below every score takes no share: the plain softmax.
    none = reference.ragged_paged_attention(*args, **kwargs, sinks=jnp.full(sinks.shape, -1e4))
    np.testing.assert_allclose(np.asarray(none), np.asarray(plain), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_entry_point_with_sinks_runs_the_kernel(monkeypatch, backend: str):
    """With sinks the entry point still takes the backend's kernel (here in interpret mode),
    and hands it the sinks."""
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.ragged_paged_attention import tpu

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(dispatch, "_is_hopper_or_newer", lambda: True)
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    seen = []

    def interpreted(*args, **kwargs):
        seen.append(kwargs.get("sinks"))
        if backend == "gpu":
            return gpu_kernel(*args, **kwargs, interpret=True)
        with pltpu.force_tpu_interpret_mode():
            return tpu_kernel(*args, **kwargs)

    gpu_kernel, tpu_kernel = mosaic_gpu.ragged_paged_attention, tpu.ragged_paged_attention
    monkeypatch.setattr(mosaic_gpu, "ragged_paged_attention", interpreted)
    monkeypatch.setattr(tpu, "ragged_paged_attention", interpreted)
    case = next(c for c in CPU_CASES if c.name == "sinks_mixed_g8")
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    assert dispatch.choose_kernel(args[0], args[1]) == (backend, None)
    got = dispatch.ragged_paged_attention(*args, **attention_kwargs(case), **sinks)
    assert len(seen) == 1 and seen[0] is sinks["sinks"]
    want = reference.ragged_paged_attention(*args, **attention_kwargs(case), **sinks)
    assert_matches(case, got, want, seed)
