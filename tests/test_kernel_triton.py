"""The Pallas Triton ragged paged attention kernel against the pure-jnp reference.

On CPU (CI) the kernel runs in Pallas interpret mode on tiny shapes, and is lowered to Triton IR
for an (abstract) A100. The ``gpu`` tests run it natively on any NVIDIA GPU over the same grid
plus larger shapes, with the outputs poisoned before each run. Inputs, the page-table shuffle
and the checks are those of the Mosaic GPU kernel's tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import dispatch, mosaic_gpu, reference, splits, triton
from tests.test_kernel_gpu import (
    GPT_OSS_SINK_CASES,
    Case,
    _poisoned_run,
    assert_matches,
    attention_kwargs,
    make_inputs,
    make_sinks,
)

# The Pallas Triton backend warns at lowering that it is deprecated (jax 0.11).
DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"

# Tiny shapes: interpret mode runs every program in turn on the CPU.
CPU_CASES = [
    # Prefill chunks over cached pages next to decodes, padding rows and a dead slot.
    Case("mixed_g4_d128", (1, 17, 1, 5), (1, 40, 16, 21), 4, 1, 128, num_pad_tokens=3,
         num_dead_slots=1),
    # head_dim 80 runs padded to 128 in registers; fp16; a decode batch (16-row tiles).
    Case("decode_d80_fp16", (1, 1, 1), (15, 16, 17), 4, 2, 80, num_pad_tokens=2,
         dtype="float16"),
    # GQA group 3 padded to 4 rows per token; head_dim 96; a split KV range; page size 8.
    Case("split_g3_d96", (1, 9, 1), (70, 9, 100), 6, 2, 96, num_splits=2, num_dead_slots=1,
         page_size=8),
    # Gemma's head_dim 256 with a sliding window and soft cap, three splits.
    Case("window_softcap_d256", (20, 1), (90, 75), 4, 2, 256, sliding_window=24, soft_cap=30.0,
         num_splits=3),
    # A page size that is no power of two.
    Case("g5_page7", (3, 1), (33, 31), 10, 2, 64, page_size=7, num_pad_tokens=1),
    # An fp8 cache (Ada's GPUs; head sizes the Mosaic fp8 path does not take): e4m3 pages over
    # mixed rows at head_dim 256, e5m2 split with a window; converted in registers, scaled.
    Case("fp8_e4m3_mixed_d256", (1, 17, 1, 5), (1, 40, 16, 21), 4, 2, 256, num_pad_tokens=3,
         num_dead_slots=1, kv_dtype=jnp.float8_e4m3fn),
    Case("fp8_e5m2_split_window", (9, 1, 1), (70, 100, 30), 8, 2, 64, num_splits=2,
         sliding_window=40, kv_dtype=jnp.float8_e5m2, k_scale=0.5, v_scale=2.0),
    # Attention sinks (GPT-OSS): GQA 8 at head_dim 64, unsplit (in the kernel) over mixed rows
    # and padding; split (in the merge) with a sliding window.
    Case("sinks_mixed_g8", (1, 17, 1, 5), (1, 40, 16, 21), 16, 2, 64, num_pad_tokens=3,
         num_dead_slots=1, num_splits=1, has_sinks=True),
    Case("sinks_split3_window_g3", (9, 1, 1), (70, 100, 30), 6, 2, 64, num_splits=3,
         sliding_window=24, has_sinks=True),
]  # fmt: skip


def kernel_call(case: Case, *, interpret: bool, block_kv: int | None = None):
    config = triton.TritonConfig(num_splits=case.num_splits, block_kv=block_kv)

    def call(*args, **sinks):
        return triton.ragged_paged_attention(
            *args, **attention_kwargs(case), **sinks, config=config, interpret=interpret
        )

    return call


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    rng = np.random.default_rng(seed)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    # 16-token KV steps: several steps per sequence even at these tiny lengths.
    out = kernel_call(case, interpret=True, block_kv=16)(*args, **sinks)
    ref = reference.ragged_paged_attention(*args, **attention_kwargs(case), **sinks)
    assert_matches(case, out, ref, seed)


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize("case", CPU_CASES[:4] + CPU_CASES[-4:], ids=lambda c: c.name)
def test_lowers_to_triton_for_an_a100(case: Case, verify_triton_modules) -> None:
    """The Pallas -> Triton IR lowering (power-of-two tensors, gathers, masks) runs on the CPU;
    only ptxas is left for the GPU. An e4m3 cache is lowered for an L4 (compute capability 8.9,
    the first with e4m3 conversions, as fp8 caches need); Triton refuses it for an A100."""
    rng = np.random.default_rng(0)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    call = kernel_call(case, interpret=False)
    kind, cores = ("NVIDIA L4", 58) if case.kv_dtype == jnp.float8_e4m3fn else ("NVIDIA A100", 108)
    gpu = jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(lambda *a: call(*a, **sinks)).trace(*args)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_config_and_shapes_are_validated():
    with pytest.raises(ValueError, match="block_kv=48 must be a power of two >= 16"):
        triton.TritonConfig(block_kv=48)
    with pytest.raises(ValueError, match=r"self.num_warps=3 must be 1, 2, 4, 8 or 16"):
        triton.TritonConfig(num_warps=3)
    case = Case("g32", (1,), (5,), 32, 1, 64)
    args = make_inputs(np.random.default_rng(0), case)
    with pytest.raises(ValueError, match=r"GQA ratio must be an integer in \[1, 16\]"):
        kernel_call(case, interpret=True)(*args)


def test_default_splits_fill_the_gpu_only_when_needed():
    assert triton.default_num_splits(512, 4096, 64, 132) == 1  # decode b=64 x 8 KV heads
    assert triton.default_num_splits(8, 4096, 64, 132) == 32  # b=1: 256 programs
    assert triton.default_num_splits(8, 128, 64, 132) == 1  # too short to split


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def _gpu_cases() -> list[Case]:
    rng = np.random.default_rng(7)
    ragged = tuple(int(x) for x in rng.integers(1, 3000, 24))
    return CPU_CASES + [
        Case("llama_decode_ragged", (1,) * 24, ragged, 32, 8, 128, num_pad_tokens=5,
             num_dead_slots=3),
        Case("llama_decode_split4", (1,) * 6, ragged[:6], 32, 8, 128, num_splits=4),
        Case("llama_mixed", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 32, 8, 128,
             num_pad_tokens=11),
        Case("gemma2_d256_mixed", (300, 1, 1, 77, 1), (300, 5000, 17, 500, 64), 16, 8, 256,
             sliding_window=4096, soft_cap=50.0),
        Case("phi3_d96_fp16", (200, 1, 1), (1200, 700, 33), 32, 32, 96, sliding_window=512,
             dtype="float16"),
        Case("g7_d80_page32", (9, 1, 130), (9, 1000, 258), 7, 1, 80, page_size=32),
        *GPT_OSS_SINK_CASES,
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
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


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
def test_entry_point_runs_the_triton_kernel_when_forced(monkeypatch):
    monkeypatch.setenv("JAXSERVE_ATTENTION", "triton")
    case = CPU_CASES[0]
    args = make_inputs(np.random.default_rng(), case)
    kwargs = attention_kwargs(case)
    jaxpr = jax.make_jaxpr(lambda *a: dispatch.ragged_paged_attention(*a, **kwargs))(*args)
    assert "ragged_paged_attention_triton" in str(jaxpr)
    out = dispatch.ragged_paged_attention(*args, **kwargs)
    assert_matches(case, out, reference.ragged_paged_attention(*args, **kwargs))


@pytest.mark.parametrize(
    "capability, head_dim, block_kv",
    [("9.0", 256, 64), ("10.0", 256, 64), ("8.0", 256, 32), ("8.9", 256, 32), ("8.0", 128, 64)],
)
def test_head_dim_256_walks_64_kv_tokens_a_step_from_hopper_on(
    monkeypatch, capability, head_dim, block_kv
):
    """Two stages of 64 x 256 K and V tiles take 128 KB of shared memory: Hopper holds them
    (and read the KV 1.3x faster so on the H200); older GPUs keep 32 at head_dim 256."""

    class Gpu:
        compute_capability = capability

    monkeypatch.setattr(triton.jax, "devices", lambda *_: [Gpu()])
    assert triton.default_block_kv(head_dim) == block_kv


# (plan, the 16-token bucket's splits on the Triton kernel (108 SMs, an A100: what it assumes off
# a GPU) and on the Mosaic GPU kernel (132 SMs)); a 32-token bucket splits once on both.
@pytest.mark.parametrize("plan, triton_16, mosaic_16", [("live", 4, 8), ("bucket", 1, 2)])
def test_a_small_bucket_is_split_for_few_live_rows(monkeypatch, plan, triton_16, mosaic_16):
    """A batch of one decodes in the 16-token bucket: its split plan counts 4 live rows, not
    16 (``splits.planned_rows``); ``JAXSERVE_ATTENTION_SPLITS=bucket`` restores the former
    rule. Larger buckets are planned as before."""
    monkeypatch.setenv(splits.SPLIT_PLAN_ENV, plan)
    for tokens, triton_want, mosaic_want in ((16, triton_16, mosaic_16), (32, 1, 1)):
        q = jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16)
        k_pages = jax.ShapeDtypeStruct((512, 16, 8, 128), jnp.bfloat16)
        page_indices = jax.ShapeDtypeStruct((tokens, 512), jnp.int32)  # 8,192 tokens a sequence
        launch = triton._launch_for(q, k_pages, page_indices, triton.TritonConfig())
        assert launch.num_splits == triton_want, (tokens, launch)
        assert mosaic_gpu.default_num_splits(tokens, tokens, 8, 8192, 64) == mosaic_want
    assert splits.planned_rows(17) == 17
    monkeypatch.setenv(splits.SPLIT_PLAN_ENV, "rows")
    with pytest.raises(ValueError, match="JAXSERVE_ATTENTION_SPLITS='rows' must be one of"):
        splits.planned_rows(16)


def test_a_long_prompt_over_few_sequence_rows_is_not_split():
    """Past the smallest bucket, more than half a step's tokens are live: a 2,048-token step
    over one sequence row (``--max-num-seqs 1``) has at least 128 tiles of 8 tokens, and its
    KV is not split (it was 8 ways, counted as one row); decode buckets are planned as before."""
    assert mosaic_gpu.default_num_splits(2048, 1, 8, 4096, 64, block_q=8) == 1
    assert mosaic_gpu.default_num_splits(64, 4, 8, 4096, 64, block_q=8) == 8  # 4 rows: 32 programs
    assert mosaic_gpu.default_num_splits(64, 64, 8, 4096, 64, block_q=8) == 1
    assert mosaic_gpu.default_num_splits(16, 16, 8, 8192, 64, block_q=8) == 8  # planned for 4


@pytest.mark.parametrize(
    "live, planned, want",
    [(1, True, 8), (4, True, 8), (5, True, 4), (16, True, 2), (40, True, 1), (1, False, 8)],
)
def test_a_launch_planned_for_few_rows_splits_as_its_live_rows_allow(
    monkeypatch, live, planned, want
):
    """``splits.with_live_splits``: a launch planned for 4 live rows (8 splits of 8 KV heads on
    132 SMs) counts its live tiles at run time and takes the splits the trace-time rule gives
    that many rows (a full 16-row decode: 2, as before the plan); a configured split count
    (``planned`` False) is every tile's. The split ranges cover each tile's KV blocks once."""
    sizes = np.zeros(48, np.int32)
    sizes[:live] = 1
    plan = jnp.zeros((5, 48), jnp.int32).at[2].set(jnp.asarray(sizes))
    got = splits.with_live_splits(plan, 8, 8, 132, planned)
    assert got.shape == (6, 48)
    np.testing.assert_array_equal(got[:5], plan)
    np.testing.assert_array_equal(got[5], want)
    monkeypatch.setenv(splits.SPLIT_PLAN_ENV, "bucket")  # the trace-time rule, every row live
    assert want == min(8, mosaic_gpu.default_num_splits(live, live, 8, 8192, 64)) or not planned
    for num_blocks in (0, 1, 3, 7, 64):
        ranges = [splits.split_range(2, num_blocks, s, jnp.int32(want)) for s in range(8)]
        lo, hi = np.asarray(ranges).T
        assert lo[0] == 2 and hi[want - 1] == 2 + num_blocks and (hi >= lo).all()
        np.testing.assert_array_equal(lo[1:want], hi[: want - 1])  # contiguous, in order
        np.testing.assert_array_equal(lo[want:], hi[want:])  # the splits past: empty


@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
def test_a_full_small_bucket_matches_the_reference_with_its_live_splits(monkeypatch, kernel):
    """The 16-token bucket planned for 4 live rows, on a GPU of 8 SMs (so that 2 KV heads and
    about 520 tokens of context plan 2 splits), with 1 and with 16 live decodes (2 and 1
    splits at run time, the other empty), against the reference (interpret mode)."""
    monkeypatch.setattr(mosaic_gpu, "NUM_SMS", 8)
    monkeypatch.setattr(triton, "num_sms", lambda: 8)
    for live in (1, 16):
        case = Case(f"bucket16_live{live}", (1,) * live, tuple(range(520, 520 + 3 * live, 3)),
                    8, 2, 64, num_pad_tokens=16 - live, num_dead_slots=16 - live)  # fmt: skip
        rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
        args = make_inputs(rng, case)
        q, k_pages, page_indices = args[0], args[1], args[4]
        launch = (
            mosaic_gpu._launch_for(q, k_pages, page_indices, mosaic_gpu.KernelConfig())
            if kernel == "mosaic"
            else triton._launch_for(q, k_pages, page_indices, triton.TritonConfig())
        )
        assert launch.num_splits == 2, launch
        ref = reference.ragged_paged_attention(*args, **attention_kwargs(case))
        if kernel == "mosaic":
            out = mosaic_gpu.ragged_paged_attention(*args, **attention_kwargs(case), interpret=True)
        else:
            out = triton.ragged_paged_attention(*args, **attention_kwargs(case), interpret=True)
        assert_matches(case, out, ref)


@pytest.mark.parametrize(
    "num_splits, with_sinks, live_splits",
    [
        (8, False, None),
        (8, True, None),
        (8, False, 6),
        (8, True, 3),
        (32, False, None),
        (32, True, 20),
    ],
)
def test_merging_splits_weights_each_by_its_softmax_mass(num_splits, with_sinks, live_splits):
    """``splits.merge_splits`` against float64 numpy on fresh random partial results: each
    split's output weighted by 2^lse (plus a sink's mass in the total), with an empty split
    (lse -1e30, as the kernels write it), a row whose splits are all empty (0, no NaN), a split
    2^200 below the others (no overflow), and rows past the batch's tokens (zeros). With
    ``live_splits``, the parts past it were never written: NaN and inf there weigh nothing.
    32 splits take the merge over the split axis (``UNROLLED_MERGE_MAX_SPLITS``)."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(2**31)))
    tokens, heads, dim = 6, 4, 16
    o = rng.normal(size=(num_splits, tokens, heads, dim))
    lse = rng.normal(scale=4.0, size=(num_splits, tokens, heads))
    lse[3] = -1e30  # an empty split
    o[3] = 0.0
    lse[:, 2] = -1e30  # a row with no keys at all
    o[:, 2] = 0.0
    lse[5, 1] = lse[:, 1].max() - 200.0  # far below the others
    garbage = (o.copy(), lse.copy())
    if live_splits is not None:  # what the merge must weigh 0: the reference leaves them out
        o, lse = o[:live_splits], lse[:live_splits]
        garbage[0][live_splits:] = np.nan
        garbage[1][live_splits:] = np.inf
        garbage[1][-1, 0] = np.nan
    sinks = rng.normal(size=heads) if with_sinks else None
    cu_q_lens, num_seqs = jnp.array([0, 3, 5, 5], jnp.int32), jnp.array([2], jnp.int32)
    lse_cols = np.repeat(garbage[1][..., None], 2, axis=-1)  # the kernels' equal columns
    got = splits.merge_splits(
        jnp.asarray(garbage[0], jnp.float32),
        jnp.asarray(lse_cols, jnp.float32),
        cu_q_lens,
        num_seqs,
        out_dtype=jnp.float32,
        sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
        live_splits=None if live_splits is None else jnp.int32(live_splits),
    )
    top = lse.max(axis=0)
    with np.errstate(all="ignore"):  # row 2: nothing to weigh (set below)
        mass = np.exp2(lse - top)  # [NS, T, H]
        sink_mass = 0 if sinks is None else np.exp2(sinks * np.log2(np.e) - top)
        want = (mass[..., None] * o).sum(axis=0) / (mass.sum(axis=0) + sink_mass)[..., None]
    want[2] = 0.0
    want[5:] = 0.0  # past cu_q_lens[num_seqs] = 5
    got = np.asarray(got)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_merging_many_splits_stays_a_small_program():
    """Above ``UNROLLED_MERGE_MAX_SPLITS`` the merge's program grows with the split count, not
    its square: at 64 splits its HLO is no longer than at 16 (the split-by-split form took 23 s
    to compile on the CPU at 64, and an H100 compile of the MLA kernel's 32 past 45 s)."""
    sizes = {}
    for num_splits in (16, 64):
        o = jax.ShapeDtypeStruct((num_splits, 8, 128, 512), jnp.float32)
        lse = jax.ShapeDtypeStruct((num_splits, 8, 128, 32), jnp.float32)
        cu, num_seqs = jax.ShapeDtypeStruct((9,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
        merge = jax.jit(lambda *a: splits.merge_splits(*a, out_dtype=jnp.bfloat16))
        sizes[num_splits] = len(merge.lower(o, lse, cu, num_seqs).as_text().splitlines())
    assert splits.UNROLLED_MERGE_MAX_SPLITS < 16
    assert sizes[64] <= sizes[16] < 200, sizes
