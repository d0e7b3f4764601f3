"""Ragged paged attention as a Pallas Mosaic GPU kernel (Hopper and newer).

Same signature and semantics as ``reference.ragged_paged_attention``. The caller (the model,
through ``dispatch.ragged_paged_attention``) passes one flattened ragged batch
in which prefill chunks and decode tokens sit side by side; this module plans the work in plain
XLA, runs one kernel launch over it and, when the KV length is split, merges the partial results.

Work decomposition. A *tile* is up to ``block_q`` consecutive query tokens of one sequence; one
program handles one tile for one KV head, so its ``G = Hq / Hkv`` query heads x ``block_q``
tokens fill the 64 rows of one wgmma (rows ordered head-major: row = g * block_q + j). The
program streams the sequence's KV pages through shared memory with TMA, ``block_kv`` tokens a
step, ``num_stages`` steps in flight (a slot's next copies issued after P.V, or earlier:
``KernelConfig.issue_next``), and keeps an online (flash) softmax in registers. Pages are
gathered per step from the page table; a page index past the sequence is replaced by an
out-of-range one, which TMA fills with zeros without touching memory. Rows past the end of the
query batch (padding) form one extra group of tiles with no KV, so they come back as zeros.

Head sizes 64, 96, 128 and 256 (80 faulted natively: see HEAD_DIMS), bf16 or fp16. The smem
swizzle follows the head size (``swizzle_for``: wgmma wants K and N in whole swizzle tiles),
and untiled Q and O, and the
f32 accumulator, are kept in column chunks of at most 128 (two at head_dim 256, whose default
``block_kv=64, num_stages=2`` needs about 200 KB of the 227 KB of shared memory).

An fp8 cache (``float8_e4m3fn`` / ``float8_e5m2`` pages, per-tensor ``k_scale`` / ``v_scale``)
lands in shared memory as it is stored (half the bytes of bf16) and is read one of two ways
(``KernelConfig.fp8_wgmma``; the serving switch is ``JAXSERVE_FP8_ATTENTION``, see dispatch.py).
The scales are applied to the float32 results either way, ``k_scale`` with the softmax scale
and ``v_scale`` with the 1 / row-sum: ``q . (k * s) = (q . k) * s``, so neither path rounds
``page * scale``.
- convert (``JAXSERVE_FP8_ATTENTION=convert``): each step converts the K and V tiles to bf16
  through registers (exact: every fp8 value is a bf16 value) into one tiled buffer each, which
  bf16 wgmmas read:
  the reference's results to bf16 rounding. Measured at 1.00x the bf16 kernel on the H200
  (batch 64 x 4,096 context, 2026-12-04) and 1.36x on an H100 (2026-12-06).
- native (``fp8_wgmma=True``, the serving default): the wgmmas run on fp8 operands. The K stages
  land tiled and swizzled for 1-byte elements and feed QK^T as they are. Q is quantized once per
  program: each row (a query head of a token) times ``448 / amax`` (its largest magnitude,
  floored at 1e-12) rounded to e4m3 into a tiled fp8 Q tile, and each row's ``amax / 448``
  multiplies its scores with ``k_scale``, the softmax scale and log2 e
  (``reference.quantize_queries`` is the same quantization in jnp). P (the exp2 probabilities,
  <= 1) is multiplied by 256, an exact power of two that keeps small probabilities normal in
  e4m3, rounded to e4m3, and the 256 is divided out with ``v_scale`` and 1 / row-sum (the
  row-sum adds the unrounded P). fp8 wgmma takes only K-major operands (Mosaic GPU: "Only f16
  WGMMA supports transposes"), so V, which PV contracts over its rows, is transposed each step:
  the fp8 stage is loaded into registers, widened to float16 (exact), moved from the WGMMA to
  the WGMMA_TRANSPOSED register layout (a shuffle and a byte permute), narrowed back to fp8
  (exact) and stored through a transposed view of a [D, block_kv] fp8 tile, which PV reads with
  P. An e5m2 cache takes the same path: wgmma mixes e4m3 (Q, P) with e5m2 (K, V^T) operands.
  Accuracy: Q's and P's rounding to e4m3 (3 mantissa bits: up to 2^-4 relative each) left
  2.3-3.3% relative error (Frobenius) against the reference on the tests' random inputs (the
  convert path: 0.2%), 1.5-2.1% against the reference over the same quantized queries;
  element-wise, P's rounding bounds the difference from the latter by 2^-4 times the
  attention-weighted mean of |v| (tests/test_attention_fp8_native.py). Shared memory is smaller
  (64 KB at head_dim 128 with the default tiles, against 104 KB converting). On an H100
  (2026-12-06) its native tests pass and decode at batch 64 x 4,096 context takes 219 us against
  bf16's 355 (1.62x; 1.67x at batch 256), with an error against the bf16 cache's attention about
  the fp8 cache's own (10.0% relative at 4,096 context, converting 9.9%).

When there are too few (tile, head) programs to fill the GPU (small decode batches) the KV range
of each tile is split ``num_splits`` ways; each split writes its normalised partial output and
its log-sum-exp (both token-indexed), and ``splits.merge_splits`` combines them in one XLA fusion.

Attention sinks (GPT-OSS, ``sinks[Hq]``): an unsplit launch reads them after the two scales in
its small f32 GMEM operand and starts each row's online softmax from its head's sink (a running
max of the sink and a sum of one, its mass, with nothing in the accumulator); a split launch
leaves them to the merge, which counts each once. Without sinks nothing changes: the operand
keeps its two scales and the loop its start.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.env_choice import env_choice
from pallas_kernels.kv_cache import FP8_DTYPES, stacked_scales
from pallas_kernels.ragged_paged_attention.splits import (
    MASK_VALUE,
    SMALL_LAUNCH_ROWS,
    merge_splits,
    planned_rows,
    split_range,
    with_live_splits,
)

ROWS = 64  # query rows per program: one wgmma M tile
LOG2E = math.log2(math.e)
LSE_COLS = 32  # the log-sum-exp is stored 32 times per row: TMA wants 128-byte smem rows
NUM_SMS = 132  # H100 / H200
SMEM_BYTES = 227 * 1024  # shared memory one block may use on H100 / H200
# The fp8 wgmma path ("native"): Q rows scaled to e4m3's largest value (``FP8_MAX / amax``, amax
# floored as ``fp8_matmul.reference.quantize_rows`` does), P (<= 1) times a power of two before
# its e4m3 rounding, so that small probabilities stay normal (e4m3 is subnormal below 2^-6).
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12
P_SCALE = 256.0
DTYPES = (jnp.bfloat16, jnp.float16)
# NOTE: not 80: its 32-byte swizzle passed in interpret mode but faulted natively on the H200
# (CUDA_ERROR_MISALIGNED_ADDRESS, 2026-12-03); the Triton kernel takes head_dim 80.
HEAD_DIMS = (64, 96, 128, 256)
ISSUE_NEXT = ("read", "p", "end")  # ``KernelConfig.issue_next``
QK_CHUNK = 64  # head_dim columns a QK^T wgmma past one column chunk (head_dim 256)


def swizzle_for(head_dim: int, itemsize: int) -> int:
    """The widest smem swizzle (bytes) whose tile width divides a head_dim row.

    wgmma takes one swizzle for both operands and wants K (and N of the PV product) in whole
    tiles of ``swizzle // itemsize`` columns: 128 bytes for head_dim 64/128/256, 64 for 96
    (3 tiles of 32 columns), 32 for 80 (5 tiles of 16). P shares V's swizzle.
    """
    for swizzle in (128, 64, 32):
        if head_dim * itemsize % swizzle == 0:
            return swizzle
    raise ValueError(f"{head_dim=} x {itemsize} bytes is not a multiple of 32 bytes")


def smem_bytes(
    head_dim: int,
    itemsize: int,
    block_kv: int,
    num_stages: int,
    *,
    kv_itemsize: int | None = None,
    fp8_wgmma: bool = False,
) -> int:
    """Shared memory of one program (the split variant, the larger one); see the scratch list.
    ``itemsize`` is the queries' element size, ``kv_itemsize`` the cache's (None: the same;
    1: fp8, converted to the queries' dtype, or read by fp8 wgmmas with ``fp8_wgmma``)."""
    kv_itemsize = kv_itemsize or itemsize
    stages = 2 * num_stages * block_kv * head_dim * kv_itemsize
    kv_or_out = max(stages, ROWS * head_dim * 4)
    lse = ROWS * LSE_COLS * 4
    if kv_itemsize == 1 and fp8_wgmma:  # fp8 Q; untiled Q, or fp8 P and V^T
        q_raw = ROWS * head_dim * itemsize
        return ROWS * head_dim + kv_or_out + max(q_raw, (ROWS + head_dim) * block_kv) + lse
    q = ROWS * head_dim * itemsize
    q_or_p = max(ROWS * head_dim, ROWS * block_kv) * itemsize
    deq = 2 * block_kv * head_dim * itemsize if kv_itemsize != itemsize else 0  # k_deq, v_deq
    return q + kv_or_out + q_or_p + lse + deq


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tuning knobs; ``num_splits=None`` picks the KV split count from the shapes."""

    block_kv: int = 64
    num_stages: int = 2
    num_splits: int | None = None
    head_major_kv: bool = False  # KV pages laid out [P, Hkv, page_size, D] (benchmark only)
    # An fp8 cache read by fp8 wgmmas (Q and P quantized to e4m3, see the module docstring);
    # False: converted to the queries' dtype. No effect on a bf16 / fp16 cache.
    fp8_wgmma: bool = False
    # When a step issues its KV slot's next copies: "read", as soon as it has read the slot's
    # stages (V transposed or converted first, then K by QK^T), before the softmax; "p",
    # after P is stored; "end", after P.V (as before). A bf16 V is read by P.V: its copy
    # follows it in every mode. The earlier, the more of the next blocks' bytes in flight.
    # NOTE: "end" until "read" and "p" have run natively (their GPU tests and
    # ``bench_attention --suite issue``); the interpreter checks their results, not the order
    # of the async copies against the reads.
    issue_next: str = "end"
    # Fewer registers a thread (``benchmarks/probes/kernel_registers.py``): P.V adds into the
    # accumulator in place (``run_state``) rather than into a second one added after it, and
    # at head_dim 256 QK^T loops over 64-column wgmmas rather than unrolling its 16 (their
    # hoisted descriptors spilled). Head_dim 256 bf16: 1,024 bytes spilled a thread -> 28
    # (0 with issue_next "read"). NOTE: off until the GPU tests run it (the interpreter has
    # no run_state: interpret mode keeps the scoped product either way).
    lean_registers: bool = False

    def __post_init__(self):
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"{self.block_kv=} must be 64, 128, 192 or 256")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"{self.num_stages=} must be in [1, 8]")
        if self.issue_next not in ISSUE_NEXT:
            raise ValueError(f"{self.issue_next=} must be one of {', '.join(ISSUE_NEXT)}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")


def block_q_for(group: int) -> int:
    """Query tokens per tile: a multiple of 8 (the smem tiling) with block_q * group <= 64."""
    if not 1 <= group <= 8:
        raise ValueError(f"{group=} (query heads per KV head) must be in [1, 8]")
    return 8 * (8 // group)


def unsupported_reason(q, k_pages, *, head_major_kv: bool = False) -> str | None:
    """Why this call cannot run on the kernel (the caller falls back to the reference); sliding
    windows and soft caps are handled in the kernel, so only shapes and dtypes count."""
    _, num_q_heads, head_dim = q.shape
    if head_major_kv:
        _, num_kv_heads, page_size, _ = k_pages.shape
    else:
        _, page_size, num_kv_heads, _ = k_pages.shape
    if q.dtype not in DTYPES:
        return f"dtypes {q.dtype}/{k_pages.dtype}: the kernel takes bfloat16 or float16 queries"
    if k_pages.dtype in FP8_DTYPES:
        # NOTE: the fp8 path (stages converted through registers) is built and tested for the
        # head sizes of one 128-column chunk that Llama, Qwen and Mistral use.
        if head_dim not in (64, 128):
            return f"{head_dim=} with an fp8 cache: the kernel takes 64 or 128"
    elif k_pages.dtype != q.dtype:
        return (
            f"dtypes {q.dtype}/{k_pages.dtype}: the cache must be in the queries' dtype or fp8 "
            "(e4m3, e5m2)"
        )
    if head_dim not in HEAD_DIMS:
        return f"{head_dim=}: the kernel takes {', '.join(map(str, HEAD_DIMS))}"
    if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= 8:
        return f"{num_q_heads=}, {num_kv_heads=}: GQA ratio must be an integer in [1, 8]"
    if page_size % 8 or (page_size & (page_size - 1)):
        return f"{page_size=}: must be a power of two >= 8"
    return None


def default_num_splits(
    num_tokens: int,
    num_slots: int,
    num_kv_heads: int,
    max_kv: int,
    block_kv: int,
    block_q: int = 8,  # query tokens per tile (``block_q_for``)
) -> int:
    """Split the KV length when the (tile, head) programs would leave the GPU half empty
    (a small launch's rows planned as ``splits.planned_rows`` says).

    A launch's tiles are at least its sequence rows (``min(num_tokens, num_slots)``) and, past
    the smallest bucket, at least half its tokens in tiles of ``block_q``: the runner takes
    the smallest bucket that holds a step's tokens, so more than half of them are live. With
    few sequence rows (``--max-num-seqs`` of 16 or less) a 2,048-token prompt counted as one
    row was split 8 ways, and its merge read 8 float32 parts (an H100, 2026-12-06: its
    attention 563 us, where the Triton kernel, which counts its tiles, took 290)."""
    rows = min(num_tokens, num_slots)
    if num_tokens > SMALL_LAUNCH_ROWS:
        rows = max(rows, num_tokens // (2 * block_q))
    programs = planned_rows(rows) * num_kv_heads
    splits = 1
    while programs * splits * 2 <= 2 * NUM_SMS and max_kv >= 2 * splits * 2 * block_kv:
        splits *= 2
    return splits


# The native fp8 path reads 128 KV tokens a step in decode-sized launches that are not split:
# on an H100 (2026-12-06, Llama-3-8B attention, benchmarks/bench_attention.py --suite fp8
# --sweep) batch 64 x 4,096 context 221 -> 208 us, 256 x 1,024 239 -> 226 us, 256 x 4,096
# 822 -> 748 us against 64 tokens a step (3 stages: no faster; 128 x 3 stages: slower). The
# bf16 kernel gained nothing (b=64 x 4,096 355 -> 357 us) and lost at batch 8 and in a step
# with a 2,048-token prompt (445 -> 494 us), so longer launches, split ones and a bf16 cache
# keep 64. 128 in every launch measured slower in the step (H100, 2026-12-06, decode_roofline
# with fp8 weights and fp8 KV, JAXSERVE_FP8_BLOCK_KV=64 against 128): batch 1 and 8 at 1,024
# and 4,096 context 0.15-0.25 ms a step slower (4.26 -> 4.46 ms at batch 1 x 1,024), though
# bench_attention timed a lone batch-1 x 4,096 launch at 44 -> 22 us; whole prompts slower too
# (8 x 256: 41.4 -> 44.7 us). ``JAXSERVE_FP8_BLOCK_KV`` (auto, 64 or 128) overrides the rule.
NATIVE_WIDE_BLOCK_KV = 128
NATIVE_WIDE_MAX_TOKENS = 1024
FP8_BLOCK_KV_ENV = "JAXSERVE_FP8_BLOCK_KV"
# ``KernelConfig.issue_next`` for served steps (benchmarks time the three in one run).
ISSUE_NEXT_ENV = "JAXSERVE_ATTENTION_ISSUE_NEXT"


def issue_next() -> str:
    """When served launches issue a KV slot's next copies (``KernelConfig.issue_next``)."""
    return env_choice(ISSUE_NEXT_ENV, ISSUE_NEXT, KernelConfig.issue_next)


# ``KernelConfig.lean_registers`` for served steps: on or off (the default, until measured).
LEAN_REGISTERS_ENV = "JAXSERVE_ATTENTION_LEAN_REGISTERS"


def lean_registers() -> bool:
    """Whether served launches take the leaner register forms (``KernelConfig``)."""
    default = "on" if KernelConfig.lean_registers else "off"
    return env_choice(LEAN_REGISTERS_ENV, ("on", "off"), default) == "on"


def native_block_kv(q, k_pages, page_indices, native: bool = True) -> int:
    """KV tokens a step for this call: the native fp8 path's (see NATIVE_WIDE_BLOCK_KV), or
    the default for any other (``native`` False: a bf16 cache, convert, batch invariance)."""
    if not native:
        return KernelConfig.block_kv
    choice = env_choice(FP8_BLOCK_KV_ENV, ("auto", "64", "128"), "auto")
    if choice != "auto":
        return int(choice)
    num_tokens = q.shape[0]
    _, page_size, num_kv_heads = _kv_geometry(k_pages, False)
    num_slots, pages_per_seq = page_indices.shape
    wide = NATIVE_WIDE_BLOCK_KV
    block_q = block_q_for(q.shape[1] // num_kv_heads)
    splits = default_num_splits(
        num_tokens, num_slots, num_kv_heads, pages_per_seq * page_size, wide, block_q
    )
    return wide if num_tokens <= NATIVE_WIDE_MAX_TOKENS and splits == 1 else KernelConfig.block_kv


def served_config(
    q, k_pages, page_indices, native: bool, batch_invariant: bool = False
) -> KernelConfig:
    """The config of a served launch: one KV split in batch-invariant mode, fp8 wgmmas over
    an fp8 cache (``native``) at ``native_block_kv``'s tokens a step, and the switches
    ``JAXSERVE_ATTENTION_ISSUE_NEXT`` and ``JAXSERVE_ATTENTION_LEAN_REGISTERS``."""
    wide = native and not batch_invariant
    return KernelConfig(
        num_splits=1 if batch_invariant else None,
        fp8_wgmma=native,
        block_kv=native_block_kv(q, k_pages, page_indices, wide),
        issue_next=issue_next(),
        lean_registers=lean_registers(),
    )


def plan_tiles(
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[1]
    *,
    num_tokens: int,
    block_q: int,
    max_tiles: int,
    with_padding: bool,
) -> jax.Array:  # i32[5, max_tiles]: seq, first token, tokens, first position, kv_len
    """Cut each sequence's query rows (and the padding rows) into tiles of block_q tokens."""
    num_slots = kv_lens.shape[0]
    n = num_seqs[0]
    is_live = jnp.arange(num_slots, dtype=jnp.int32) < n  # bool[S]
    q_lens = jnp.where(is_live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # i32[S]
    live_end = cu_q_lens[n]
    pad_len = (num_tokens - live_end) if with_padding else jnp.int32(0)
    g_start = jnp.concatenate([cu_q_lens[:-1], live_end[None]])  # i32[S + 1]
    g_len = jnp.concatenate([q_lens, pad_len[None]]).astype(jnp.int32)  # i32[S + 1]
    g_kv = jnp.concatenate([jnp.where(is_live, kv_lens, 0), jnp.zeros(1, jnp.int32)])
    g_tiles = (g_len + block_q - 1) // block_q  # i32[S + 1]
    cu_tiles = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(g_tiles, dtype=jnp.int32)])
    tile = jnp.arange(max_tiles, dtype=jnp.int32)  # i32[max_tiles]
    # compare_all: one fusion (the default binary search is a loop, slow on GPU).
    grp = jnp.searchsorted(cu_tiles[1:], tile, side="right", method="compare_all")
    grp = grp.astype(jnp.int32)
    grp = jnp.minimum(grp, num_slots)  # i32[max_tiles]
    first = (tile - cu_tiles[grp]) * block_q  # i32[max_tiles]  offset inside the group
    size = jnp.clip(g_len[grp] - first, 0, block_q)
    size = jnp.where(tile < cu_tiles[-1], size, 0)
    pos0 = g_kv[grp] - g_len[grp] + first
    seq = jnp.minimum(grp, num_slots - 1)
    return jnp.stack([seq, g_start[grp] + first, size, pos0, g_kv[grp]]).astype(jnp.int32)


class TileLaunch(Protocol):
    """What ``launch_plan`` reads of a GPU kernel's launch (each kernel's ``_Launch``)."""

    @property
    def block_q(self) -> int: ...
    @property
    def max_tiles(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def num_splits(self) -> int: ...


def launch_plan(
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[1]
    num_tokens: int,
    launch: TileLaunch,
    num_sms: int,
    *,
    planned: bool,  # the launch's num_splits came from the split rule (not a config)
) -> jax.Array:  # i32[6, max_tiles]
    """The GPU attention kernels' plan: ``plan_tiles``' rows (with the padding rows' tiles
    when the launch is not split), then each tile's splits (``splits.with_live_splits``)."""
    plan = plan_tiles(
        cu_q_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        num_tokens=num_tokens,
        block_q=launch.block_q,
        max_tiles=launch.max_tiles,
        with_padding=launch.num_splits == 1,
    )
    return with_live_splits(plan, launch.num_kv_heads, launch.num_splits, num_sms, planned)


def max_tiles_for(num_tokens: int, num_slots: int, block_q: int) -> int:
    """Upper bound on the tile count: every group adds at most one partial tile."""
    return max(1, min(num_tokens // block_q + num_slots + 1, num_tokens))


def _attention_kernel(
    plan_ref,  # i32[6, max_tiles] (GMEM): plan_tiles', then with_live_splits' row
    pages_ref,  # i32[S, pages_per_seq] (GMEM)
    q_ref,  # [T, Hq, D]
    k_ref,  # [P, page_size, Hkv, D] or [P, Hkv, page_size, D]
    v_ref,
    scales_ref,  # f32[2] (GMEM): k_scale, v_scale; then, with sinks, f32[Hq] of sink logits
    o_ref,  # [T, Hq, D] (q dtype) or f32[num_splits, T, Hq, D]
    lse_ref,  # f32[num_splits, T, Hq, LSE_COLS] or None
    q_smem,  # [ROWS, D] tiled for wgmma (native fp8: Q quantized to e4m3)
    kv_or_out,  # ((k_smem, v_smem) [num_stages, block_kv, D] tiled, o_smem [C, ROWS, D / C])
    q_or_p,  # (q_raw [C, ROWS, D / C] untiled, p_smem [ROWS, block_kv] tiled); native fp8:
    #          (q_raw, (p_smem e4m3, vt_smem [D, block_kv] tiled: the V tile transposed))
    lse_smem,  # f32[ROWS, LSE_COLS] untiled, or None
    q_bar,
    k_bar,  # [num_stages]
    v_bar,
    k_deq,  # [block_kv, D] q dtype, tiled: the fp8 K tile converted; None for a bf16 cache
    v_deq,
    *,
    cfg: KernelConfig,
    is_scaled: bool,
    has_sinks: bool,
    group: int,
    block_q: int,
    page_size: int,
    num_pages: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpreted: bool = False,
):
    # Shared memory reused across phases: KV stages and P live in the loop, Q arrives untiled
    # before it, the output leaves after it.
    native = is_native(k_ref, cfg)  # an fp8 cache read by fp8 wgmmas
    (k_smem, v_smem), o_smem = kv_or_out
    q_raw, p_part = q_or_p
    p_smem, vt_smem = p_part if native else (p_part, None)
    tile = lax.axis_index("tile")
    split = lax.axis_index("split")
    head = lax.axis_index("head")
    block_kv, stages = cfg.block_kv, cfg.num_stages
    pages_per_seq = pages_ref.shape[1]
    rows_per_copy = min(page_size, block_kv)
    copies = block_kv // rows_per_copy

    k_scale = scales_ref[0] if is_scaled else 1.0
    v_scale = scales_ref[1] if is_scaled else 1.0
    seq = plan_ref[0, tile]
    t0 = plan_ref[1, tile]
    size = plan_ref[2, tile]
    pos0 = plan_ref[3, tile]
    kv_len = plan_ref[4, tile]
    live_splits = plan_ref[5, tile]  # of the launch's num_splits, the ones this tile takes

    # A split past the tile's live ones returns at once: the merge ignores what its part holds.
    @pl.when((size > 0) & (split < live_splits))
    def _():
        pos_last = pos0 + size - 1
        kv_hi = jnp.clip(pos_last + 1, 0, kv_len)
        kb_hi = (kv_hi + block_kv - 1) // block_kv
        kb_lo = jnp.int32(0)
        if sliding_window is not None:
            kb_lo = jnp.clip(pos0 - sliding_window + 1, 0, kv_hi) // block_kv
        num_blocks = kb_hi - kb_lo
        s_lo, s_hi = split_range(kb_lo, num_blocks, split, live_splits)
        # Blocks [u_lo, u_hi) need no mask: every row sees every token in them. The masked
        # blocks on either side are processed first, then the open ones (the online softmax
        # does not care about order); step i works on block_of(i) in slot i % num_stages.
        u_lo = kb_lo
        if sliding_window is not None:
            u_lo = (jnp.maximum(pos_last - sliding_window + 1, 0) + block_kv - 1) // block_kv
        u_lo = jnp.clip(u_lo, s_lo, s_hi)
        u_hi = jnp.clip(jnp.minimum(pos0 + 1, kv_hi) // block_kv, u_lo, s_hi)
        num_front = u_lo - s_lo
        num_masked = num_front + s_hi - u_hi
        num_steps = s_hi - s_lo

        def block_of(i):
            back = jnp.where(i < num_masked, u_hi + i - num_front, u_lo + i - num_masked)
            return jnp.where(i < num_front, s_lo + i, back)

        num_seq_pages = (kv_len + page_size - 1) // page_size

        # Tiled smem needs 8-aligned source rows, so Q lands untiled and is retiled through
        # registers (rows past G * block_q stay unused: their results are never stored).
        # Untiled Q and O are kept in column chunks of at most 128 (C = num_cols of them):
        # Mosaic GPU finds no register <-> smem transfer for untiled rows of 256 x 2 bytes.
        num_cols, col_width = q_raw.shape[0], q_raw.shape[-1]
        cols = [pl.ds(c * col_width, col_width) for c in range(num_cols)]
        for g in range(group):
            for c in range(num_cols):
                plgpu.copy_gmem_to_smem(
                    q_ref.at[pl.ds(t0, block_q), head * group + g, cols[c]],
                    q_raw.at[c, pl.ds(g * block_q, block_q)],
                    q_bar,
                )

        def lookup_pages(block):  # the page of each copy of KV block `block`
            pages = []
            for c in range(copies):
                page_slot = (block * block_kv + c * rows_per_copy) // page_size
                page = pages_ref[seq, jnp.minimum(page_slot, pages_per_seq - 1)]
                # Past the sequence: an out-of-range page, which TMA fills with zeros.
                pages.append(jnp.where(page_slot < num_seq_pages, page, num_pages))
            return pages

        k_stage, v_stage = (k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)

        def issue(block, slot, pages, stages_of=(k_stage, v_stage)):
            if page_size > block_kv:
                first_row = lax.rem(block, page_size // block_kv) * block_kv
            else:
                first_row = 0
            rows = pl.ds(first_row, rows_per_copy)
            for c, page in enumerate(pages):
                dst = pl.ds(c * rows_per_copy, rows_per_copy)
                for src, dst_smem, bar in stages_of:
                    view = (
                        src.at[page, head, rows] if cfg.head_major_kv else src.at[page, rows, head]
                    )
                    plgpu.copy_gmem_to_smem(view, dst_smem.at[slot, dst], bar.at[slot])

        for i in range(stages):
            pl.when(i < num_steps)(lambda i=i: issue(block_of(i), i, lookup_pages(block_of(i))))
        plgpu.barrier_wait(q_bar)
        # The scores' scale: a scalar, or (native fp8) each row's, with its Q dequantization.
        qk_scale = k_scale * (sm_scale / soft_cap if soft_cap is not None else sm_scale * LOG2E)
        if native:
            qk_scale = _quantize_q(q_raw, q_smem) * qk_scale  # f32[ROWS]
        # NOTE: the register layout is given, so layout inference need not search for one.
        for c in range(0 if native else num_cols):
            q_part = plgpu.layout_cast(q_raw[c], plgpu.Layout.WGMMA)
            if num_cols == 1:
                q_smem[...] = q_part
            else:
                q_smem[:, cols[c]] = q_part
        plgpu.commit_smem()

        row_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
        col_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
        row_pos = pos0 + lax.rem(row_ids, block_q)  # i32[ROWS, block_kv]

        def step(i, carry, *, masked):
            acc, m_i, l_i = carry
            block = block_of(i)
            slot = lax.rem(i, stages)
            # Read the page table for the block this step issues (``issue_next``) now, so the
            # scalar loads overlap this step's math.
            next_block = block_of(i + stages)
            next_pages = lookup_pages(next_block)
            plgpu.barrier_wait(k_bar.at[slot])
            k_tile = k_smem.at[slot]
            if k_deq is not None:  # fp8 -> bf16 through registers, for the wgmma
                k_deq[...] = k_smem[slot].astype(jnp.float32).astype(k_deq.dtype)
                plgpu.commit_smem()
                k_tile = k_deq

            more = i + stages < num_steps
            v_read = native or v_deq is not None  # V read into V^T or converted before P.V
            at_read = cfg.issue_next == "read"

            def read_v():  # the V stage into V^T (fp8 wgmma operands are K-major) or bf16
                plgpu.barrier_wait(v_bar.at[slot])
                if native:
                    vt_smem.transpose((1, 0))[...] = _transposed_tile(v_smem.at[slot])
                else:
                    v_deq[...] = v_smem[slot].astype(jnp.float32).astype(v_deq.dtype)

            def qk_scope(acc_ref):
                if num_cols == 1 or not cfg.lean_registers:
                    plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
                    return acc_ref[...]

                # Over head_dim 256 a loop of 64-column wgmmas (``lean_registers``): unrolled,
                # its loop-invariant Q descriptors were hoisted out of the KV loop and spilled.
                width = QK_CHUNK

                def part(c, carry):
                    chunk = pl.ds(pl.multiple_of(c * width, width), width)
                    k_part = k_tile.at[:, chunk].transpose((1, 0))
                    plgpu.wgmma(acc_ref, q_smem.at[:, chunk], k_part)
                    return carry

                lax.fori_loop(0, q_smem.shape[-1] // width, part, None)
                return acc_ref[...]

            def issue_copies(copied):
                pl.when(more)(lambda: issue(next_block, slot, next_pages, copied))

            # A slot's next copies (``issue_next``): "read", once V is read (before QK^T: with
            # the scores and the accumulator live, V's registers would spill) and every warp
            # has waited for QK^T (the barrier of the commit), before the softmax; "p", after
            # P is stored; "end", after P.V. A bf16 V is read by P.V: its copy after it.
            read_first = (k_stage, v_stage) if v_read else (k_stage,)
            if at_read and v_read:
                read_v()
            s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS, block_kv), jnp.float32))
            if at_read:
                plgpu.commit_smem()
                issue_copies(read_first)
            s = s * (lax.broadcast_in_dim(qk_scale, s.shape, [0]) if native else qk_scale)
            if soft_cap is not None:
                s = jnp.tanh(s) * (soft_cap * LOG2E)
            if masked:
                kv_pos = block * block_kv + col_ids
                mask = (kv_pos <= row_pos) & (kv_pos < kv_len)
                if sliding_window is not None:
                    mask = mask & (kv_pos > row_pos - sliding_window)
                s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            p_smem[...] = (p * P_SCALE if native else p).astype(p_smem.dtype)
            if v_read and not at_read:
                read_v()
            plgpu.commit_smem()  # P (and V^T or the converted V)
            if not v_read:
                plgpu.barrier_wait(v_bar.at[slot])
            v_tile = v_smem.at[slot]
            if native:
                v_tile = vt_smem.transpose((1, 0))
            elif v_deq is not None:
                v_tile = v_deq
            if cfg.issue_next == "p":
                issue_copies(read_first)

            def pv(a, c):  # acc chunk c rescaled, plus P V's columns of it
                v = v_tile if num_cols == 1 else v_smem.at[slot, :, cols[c]]
                rescaled = a * lax.broadcast_in_dim(alpha, a.shape, [0])
                if interpreted or not cfg.lean_registers:  # a scoped product added after

                    def scoped(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, v)
                        return acc_ref[...]

                    return rescaled + pl.run_scoped(scoped, plgpu.ACC(a.shape, jnp.float32))

                def product(acc_ref):  # (the interpreter has no run_state)
                    plgpu.wgmma(acc_ref, p_smem, v)

                return pl.run_state(product)(plgpu.ACC.init(rescaled))

            # NOTE: the accumulator is kept in column chunks of at most 128 and PV is computed a
            # chunk at a time (in place with ``lean_registers``: a product into a second
            # accumulator holds another [64, 128] f32 live, 64 registers a thread).
            acc = tuple(pv(a, c) for c, a in enumerate(acc))
            if cfg.issue_next == "end" or not v_read:
                issue_copies((k_stage, v_stage) if cfg.issue_next == "end" else (v_stage,))
            return acc, m_new, l_i

        acc_0 = tuple(
            plgpu.layout_cast(jnp.zeros((ROWS, col_width), jnp.float32), plgpu.Layout.WGMMA)
            for _ in range(num_cols)
        )
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        if has_sinks:  # the sink as a first column with no value: max = sink, sum = 1
            sink = jnp.full((ROWS, block_kv), scales_ref[2 + head * group] * LOG2E, jnp.float32)
            sink = plgpu.layout_cast(sink, plgpu.Layout.WGMMA)  # f32[ROWS, block_kv]
            for g in range(1, group):  # rows g * block_q ... belong to query head g
                sink_g = scales_ref[2 + head * group + g] * LOG2E
                sink = jnp.where(row_ids >= g * block_q, sink_g, sink)
            m_0 = sink.max(axis=1)  # f32[ROWS]
            l_0 = plgpu.layout_cast(jnp.ones((ROWS,), jnp.float32), row_layout)
        else:
            m_0 = plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), row_layout)
            l_0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
        carry = (acc_0, m_0, l_0)
        masked_step = functools.partial(step, masked=True)
        open_step = functools.partial(step, masked=False)
        carry = lax.fori_loop(0, num_masked, masked_step, carry)
        acc, m_i, l_i = lax.fori_loop(num_masked, num_steps, open_step, carry)

        is_empty = l_i == 0.0
        inv_l = (v_scale / P_SCALE if native else v_scale) / jnp.where(is_empty, 1.0, l_i)
        for c, a in enumerate(acc):
            o = (a * lax.broadcast_in_dim(inv_l, a.shape, [0])).astype(o_smem.dtype)
            o_smem[c] = plgpu.layout_cast(o, plgpu.Layout.WGMMA)
        if lse_smem is not None:
            lse = jnp.where(is_empty, MASK_VALUE, m_i + jnp.log2(l_i))
            lse_smem[...] = lax.broadcast_in_dim(lse, lse_smem.shape, [0])
        plgpu.commit_smem()
        o_dst = o_ref.at[split] if lse_ref is not None else o_ref
        outs = [(o_smem.at[c], o_dst, cols[c]) for c in range(num_cols)]
        if lse_ref is not None:
            outs.append((lse_smem, lse_ref.at[split], slice(None)))
        for g in range(group):
            start = jnp.int32(0)
            chunk = block_q
            while chunk:
                # TMA boxes have static shapes: store `size` rows as a sum of powers of two.
                @pl.when(size & chunk != 0)
                def _(start=start, chunk=chunk, g=g):
                    for src, dst, col in outs:
                        plgpu.copy_smem_to_gmem(
                            src.at[pl.ds(g * block_q + start, chunk)],
                            dst.at[pl.ds(t0 + start, chunk), head * group + g, col],
                        )

                start = start + (size & chunk)
                chunk //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _quantize_q(q_raw, q8_smem) -> jax.Array:  # f32[ROWS]: each row's amax / FP8_MAX
    """Each query row of the landed Q (one column chunk: the fp8 head sizes) scaled to e4m3's
    range and stored into the fp8 wgmma's Q tile, as ``reference.quantize_queries`` does."""
    q = plgpu.layout_cast(q_raw[0], plgpu.Layout.WGMMA).astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(q), axis=1), AMAX_FLOOR)
    factor = lax.broadcast_in_dim(FP8_MAX / amax, q.shape, [0])
    q8_smem[...] = (q * factor).astype(q8_smem.dtype)
    return amax / FP8_MAX


def _transposed_tile(tile):  # [block_kv, D] fp8 (smem) -> the same values, laid out for [D, bk]
    """An fp8 KV tile in registers, laid out for a store through a transposed [D, block_kv]
    view. Mosaic GPU transposes 16- and 32-bit register layouts only (a shuffle and a byte
    permute: WGMMA -> WGMMA_TRANSPOSED), so the tile goes through float16 (exact both ways)."""
    v = plgpu.layout_cast(tile[...], plgpu.Layout.WGMMA).astype(jnp.float16)
    return plgpu.layout_cast(v, plgpu.Layout.WGMMA_TRANSPOSED).astype(tile.dtype)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, Hkv, D]
    v_pages: jax.Array,  # [P, page_size, Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | float | None = None,  # f32[]: the fp8 cache holds k / k_scale
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,  # [Hq]  a logit per query head in each row's denominator
    config: KernelConfig = KernelConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:  # [T, Hq, D], q's dtype
    """Mosaic GPU ragged paged attention; see the module docstring for the work layout."""
    _check_call(q, k_pages, sliding_window, sinks, config)
    launch = _launch_for(q, k_pages, page_indices, config)
    is_split = launch.num_splits > 1
    planned = config.num_splits is None
    plan = launch_plan(cu_q_lens, kv_lens, num_seqs, q.shape[0], launch, NUM_SMS, planned=planned)
    has_sinks = sinks is not None and not is_split  # (a split launch leaves them to the merge)
    scales = scales_operand(k_scale, v_scale, sinks if has_sinks else None)
    body = functools.partial(
        _attention_kernel,
        cfg=config,
        is_scaled=k_scale is not None or v_scale is not None,
        has_sinks=has_sinks,
        group=launch.group,
        block_q=launch.block_q,
        page_size=launch.page_size,
        num_pages=launch.num_pages,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpreted=bool(interpret),
    )
    outs = plgpu.kernel(
        body if is_split else _with_no_lse(body),
        out_type=_out_types(q, launch.num_splits),
        scratch_types=_scratch_types(q, k_pages, launch, config),
        grid=(launch.max_tiles, launch.num_splits, launch.num_kv_heads),
        grid_names=("tile", "split", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="ragged_paged_attention",
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret,
    )(plan, page_indices.astype(jnp.int32), q, k_pages, v_pages, scales)
    if not is_split:
        return outs[0]
    parts, lse = outs
    live = plan[5, 0]
    return merge_splits(
        parts, lse, cu_q_lens, num_seqs, out_dtype=q.dtype, sinks=sinks, live_splits=live
    )


class _Launch(NamedTuple):
    """The static shape of one launch, from the shapes and the config."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    block_q: int  # query tokens per tile
    num_splits: int  # of each tile's KV range
    max_tiles: int  # the grid's tile axis: every tile the plan may hold


def _launch_for(q, k_pages, page_indices, config: KernelConfig) -> _Launch:
    """Tiles, KV splits and grid for this call (``config.num_splits`` or the default)."""
    num_tokens, num_q_heads, _ = q.shape
    num_pages, page_size, num_kv_heads = _kv_geometry(k_pages, config.head_major_kv)
    num_slots, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    block_q = block_q_for(group)
    num_splits = config.num_splits or default_num_splits(
        num_tokens, num_slots, num_kv_heads, pages_per_seq * page_size, config.block_kv, block_q
    )
    max_tiles = max_tiles_for(num_tokens, num_slots, block_q)
    return _Launch(num_pages, page_size, num_kv_heads, group, block_q, num_splits, max_tiles)


def _kv_geometry(k_pages, head_major_kv: bool) -> tuple[int, int, int]:
    """``(num_pages, page_size, num_kv_heads)`` of a cache laid out ``[P, page_size, Hkv, D]``
    (or ``[P, Hkv, page_size, D]``, head-major)."""
    if head_major_kv:
        num_pages, num_kv_heads, page_size, _ = k_pages.shape
    else:
        num_pages, page_size, num_kv_heads, _ = k_pages.shape
    return num_pages, page_size, num_kv_heads


def _check_call(q, k_pages, sliding_window, sinks, config: KernelConfig) -> None:
    """Raise ValueError for a call the kernel does not take, or whose tiles do not fit."""
    reason = unsupported_reason(q, k_pages, head_major_kv=config.head_major_kv)
    if reason is not None:
        raise ValueError(f"ragged_paged_attention on Mosaic GPU: {reason}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1")
    _, num_q_heads, head_dim = q.shape
    _, page_size, _ = _kv_geometry(k_pages, config.head_major_kv)
    block_kv, stages = config.block_kv, config.num_stages
    if page_size > block_kv and page_size % block_kv:
        raise ValueError(f"{page_size=} must be a multiple of {block_kv=}")
    native = is_native(k_pages, config)
    smem = smem_bytes(
        head_dim,
        jnp.dtype(q.dtype).itemsize,
        block_kv,
        stages,
        kv_itemsize=jnp.dtype(k_pages.dtype).itemsize,
        fp8_wgmma=native,
    )
    if smem > SMEM_BYTES:
        path = " (fp8 wgmma)" if native else ""
        raise ValueError(
            f"{head_dim=} with {block_kv=} and num_stages={stages}{path} needs {smem:,} bytes "
            f"of shared memory; the limit is {SMEM_BYTES:,}: lower block_kv or num_stages"
        )
    if sinks is not None and sinks.shape != (num_q_heads,):
        raise ValueError(f"{sinks.shape=} must be ({num_q_heads},): one logit per query head")


def is_native(k_pages, config: KernelConfig) -> bool:
    """Whether this call reads its cache with fp8 wgmmas: an fp8 cache and ``fp8_wgmma``."""
    return config.fp8_wgmma and k_pages.dtype in FP8_DTYPES


def scales_operand(k_scale, v_scale, sinks: jax.Array | None) -> jax.Array:
    """The kernel's small f32 GMEM operand: ``[k_scale, v_scale]`` (1.0 for None), then, for a
    launch that takes them, the sink logits: f32[2] or f32[2 + Hq]. The Triton kernel's scales
    operand is the first form."""
    scales = stacked_scales(k_scale, v_scale)  # f32[2]
    if sinks is not None:
        scales = jnp.concatenate([scales, sinks.astype(jnp.float32)])  # f32[2 + Hq]
    return scales


def _out_types(q: jax.Array, num_splits: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``(o,)`` in q's dtype; or, when the KV is split, ``(o, lse)`` per split in float32."""
    if num_splits == 1:
        return (jax.ShapeDtypeStruct(q.shape, q.dtype),)
    num_tokens, num_q_heads, head_dim = q.shape
    return (
        jax.ShapeDtypeStruct((num_splits, num_tokens, num_q_heads, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_tokens, num_q_heads, LSE_COLS), jnp.float32),
    )


def _scratch_types(q: jax.Array, k_pages: jax.Array, launch: _Launch, config: KernelConfig) -> list:
    """The kernel body's shared memory and barriers, in its argument order (``q_smem`` to
    ``v_deq``); ``smem_bytes`` counts the same buffers."""
    head_dim = q.shape[-1]
    block_kv, stages = config.block_kv, config.num_stages
    o_dtype = jnp.float32 if launch.num_splits > 1 else q.dtype
    col_width = min(head_dim, 128)
    num_cols = head_dim // col_width
    copies = block_kv // min(launch.page_size, block_kv)  # TMA copies per KV step (pages)
    q_smem, kv_stage, p_smem, kv_deq = _tile_buffers(q.dtype, k_pages.dtype, head_dim, config)
    return [
        q_smem,
        plgpu.RefUnion((kv_stage, kv_stage), plgpu.SMEM((num_cols, ROWS, col_width), o_dtype)),
        plgpu.RefUnion(plgpu.SMEM((num_cols, ROWS, col_width), q.dtype), p_smem),
        plgpu.SMEM((ROWS, LSE_COLS), jnp.float32) if launch.num_splits > 1 else None,
        plgpu.Barrier(num_arrivals=launch.group * num_cols),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        kv_deq,
        kv_deq,
    ]


def _tiled(swizzle: int, itemsize: int) -> tuple:
    """The smem transforms wgmma operands take: 8-row tiles of one swizzle's width."""
    # jax 0.11.2: these subclass the Transform protocol without overriding transform_array,
    # whose body only raises, so mypy takes them for abstract classes; jax uses them as here.
    return (
        plgpu.TilingTransform((8, swizzle // itemsize)),  # type: ignore[abstract]
        plgpu.SwizzleTransform(swizzle),  # type: ignore[abstract]
    )


def _tile_buffers(q_dtype, kv_dtype, head_dim: int, config: KernelConfig) -> tuple:
    """``(q_smem, kv_stage, p_smem, kv_deq)``: the wgmmas' Q tile, one of the K / V stage
    arrays, the P tile (native fp8: P and the transposed V tile) and the converted fp8 tile
    (None unless an fp8 cache is converted)."""
    block_kv, stages = config.block_kv, config.num_stages
    stage_shape = (stages, block_kv, head_dim)
    itemsize = jnp.dtype(q_dtype).itemsize
    tiled = _tiled(swizzle_for(head_dim, itemsize), itemsize)
    q_smem = plgpu.SMEM((ROWS, head_dim), q_dtype, transforms=tiled)
    p_smem = plgpu.SMEM((ROWS, block_kv), q_dtype, transforms=tiled)
    if jnp.dtype(kv_dtype) not in FP8_DTYPES:
        return q_smem, plgpu.SMEM(stage_shape, kv_dtype, transforms=tiled), p_smem, None
    if not config.fp8_wgmma:
        # fp8 stages land untiled: only the conversion to bf16 reads them, the wgmmas do not.
        kv_deq = plgpu.SMEM((block_kv, head_dim), q_dtype, transforms=tiled)
        return q_smem, plgpu.SMEM(stage_shape, kv_dtype), p_smem, kv_deq
    # fp8 wgmma: Q (e4m3) and the K stages in tiles of head_dim's swizzle (QK^T contracts over
    # head_dim), P (e4m3) and V^T in tiles of block_kv's (PV contracts over block_kv).
    qk_tiled = _tiled(swizzle_for(head_dim, 1), 1)
    pv_tiled = _tiled(swizzle_for(block_kv, 1), 1)
    q8_smem = plgpu.SMEM((ROWS, head_dim), jnp.float8_e4m3fn, transforms=qk_tiled)
    p_and_vt = (
        plgpu.SMEM((ROWS, block_kv), jnp.float8_e4m3fn, transforms=pv_tiled),
        plgpu.SMEM((head_dim, block_kv), kv_dtype, transforms=pv_tiled),
    )
    return q8_smem, plgpu.SMEM(stage_shape, kv_dtype, transforms=qk_tiled), p_and_vt, None


def _with_no_lse(body):
    """Adapt the kernel body to the single-output launch (no lse output, no lse scratch)."""

    def wrapped(plan, pages, q, k, v, scales, o, *scratch):
        return body(plan, pages, q, k, v, scales, o, None, *scratch)

    return wrapped
