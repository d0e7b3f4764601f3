"""The Pallas Triton multi-head latent attention kernel against the pure-jnp reference, and the
dispatch between them.

On CPU (CI) the kernel runs in Pallas interpret mode on tiny shapes (16 heads, latent 64, rope
16) over a grid of batch (1, 3), context (short, several pages, not page-aligned), chunking
(decode-only, prefill-only, mixed with a chunked prefill) and shuffled page tables, with fresh
random inputs each run; at DeepSeek-V3's shapes (128 heads, 512 + 64) it is lowered to Triton
IR for an (abstract) H200 and A100. The ``gpu`` tests run it natively at the real shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import mla, rope
from jaxserve.models.batch import Batch
from jaxserve.models.families.registry import model_config_from_dict
from jaxserve.models.layers import LayerWeights
from pallas_kernels.kv_cache import quantize_kv
from pallas_kernels.mla import dispatch, reference
from pallas_kernels.mla.triton import MlaConfig, ragged_paged_mla_attention, unsupported_reason
from tests.conftest import reference_compiled_plainly, run_with_devices
from tests.test_kernel_gpu import _poisoned_run

DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
SCALES = {"ckv_scale": 0.5, "kpe_scale": 2.0}  # an fp8 cache's


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]  # new tokens per live sequence
    kv_lens: tuple[int, ...]  # cached tokens per live sequence, the new ones included
    num_heads: int = 16
    latent: int = 64
    rope_dim: int = 16
    page_size: int = 8
    num_pad_tokens: int = 0  # rows past the last sequence's (a token bucket's padding)
    num_dead_slots: int = 0  # page-table rows past num_seqs
    cache_dtype: str = "bfloat16"  # or "float8_e4m3fn", with SCALES
    config: MlaConfig = MlaConfig(block_kv=16)  # several KV steps even at tiny lengths


def make_inputs(
    rng: np.random.Generator, case: Any, spare_columns: int = 0
) -> tuple[jax.Array, ...]:
    """(q_latent, q_pe, ckv_pages, kpe_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    bf16 queries, the cache over shuffled pages (a pool with spare pages), dead slots with
    stale lengths and pages; ``spare_columns`` page-table entries past the longest sequence's.
    ``case``: any kernel's test case with this file's ``Case`` fields."""
    num_seqs = len(case.q_lens)
    num_slots = num_seqs + case.num_dead_slots
    pages_per_seq = -(-max(case.kv_lens) // case.page_size) + spare_columns
    num_pages = num_slots * pages_per_seq + 3
    page_indices = rng.permutation(num_pages)[: num_slots * pages_per_seq]
    kv_lens = list(case.kv_lens) + [int(rng.integers(1, 9))] * case.num_dead_slots
    cu = np.concatenate([[0], np.cumsum(case.q_lens)])
    cu = np.concatenate([cu, [cu[-1]] * case.num_dead_slots])
    num_tokens = int(cu[-1]) + case.num_pad_tokens
    heads, latent, rope_dim = case.num_heads, case.latent, case.rope_dim

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    cache = jnp.dtype(case.cache_dtype)
    is_fp8 = cache != jnp.bfloat16
    ckv = quantize_kv(normal(num_pages, case.page_size, 1, latent), cache,
                      SCALES["ckv_scale"] if is_fp8 else None)  # fmt: skip
    kpe = quantize_kv(normal(num_pages, case.page_size, 1, rope_dim), cache,
                      SCALES["kpe_scale"] if is_fp8 else None)  # fmt: skip
    return (
        normal(num_tokens, heads, latent).astype(jnp.bfloat16),
        normal(num_tokens, heads, rope_dim).astype(jnp.bfloat16),
        ckv,
        kpe,
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(page_indices.reshape(num_slots, pages_per_seq), jnp.int32),
        jnp.asarray(cu, jnp.int32),
        jnp.asarray([num_seqs], jnp.int32),
    )


def attention_kwargs(case: Any) -> dict:
    scales = SCALES if case.cache_dtype != "bfloat16" else {}
    return dict(sm_scale=(case.latent + case.rope_dim) ** -0.5, **scales)


def assert_matches(case: Case, out: jax.Array, ref: jax.Array, seed: int) -> None:
    """Within bf16 tolerance (the kernel's probabilities meet the latent in bf16); the
    padding rows exactly zero, as the reference's."""
    live = int(sum(case.q_lens))
    got, want = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(got[:live], want[:live], atol=2e-2, rtol=2e-2, err_msg=f"{seed=}")
    assert not got[live:].any(), f"padding rows written ({seed=})"


CPU_CASES = [
    # Decode-only: one sequence, five pages, the last one part full.
    Case("decode_b1_unaligned", (1,), (37,)),
    # Decode-only, batch 3: a short context, a page-aligned one, a split KV range, a dead slot.
    Case("decode_b3_split", (1, 1, 1), (5, 40, 23), num_pad_tokens=1, num_dead_slots=1,
         config=MlaConfig(block_kv=16, num_splits=2)),
    # Prefill-only: one whole prompt, 4 tokens x 16 heads a program.
    Case("prefill_b1", (21,), (21,), num_pad_tokens=3),
    # Prefill-only, batch 3, page size 16.
    Case("prefill_b3", (6, 16, 3), (6, 16, 3), page_size=16),
    # Mixed ragged step: decodes beside a 9-token chunk of a prompt with 16 tokens cached.
    Case("mixed_chunked_b3", (1, 9, 1), (30, 25, 12), num_pad_tokens=3, num_dead_slots=1),
    # The same mix over an fp8 (e4m3) cache with per-tensor scales, split two ways.
    Case("mixed_fp8_split", (1, 9, 1), (30, 25, 12), num_pad_tokens=2,
         cache_dtype="float8_e4m3fn", config=MlaConfig(block_kv=16, num_splits=2)),
    # 12 heads in blocks of 8: the second block half empty; a page size of 5.
    Case("heads12_block8", (1, 5), (19, 5), num_heads=12, page_size=5,
         config=MlaConfig(block_kv=16, block_h=8)),
    # rope 8 (the DeepSeek-V3 fixture's): padded to 16 in registers, a dot's smallest K.
    Case("rope8_mixed", (1, 6), (14, 6), rope_dim=8),
]  # fmt: skip


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case) -> None:
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    args = make_inputs(np.random.default_rng(seed), case)
    kwargs = attention_kwargs(case)
    call = functools.partial(
        ragged_paged_mla_attention, **kwargs, config=case.config, interpret=True
    )
    out = jax.jit(call)(*args)  # jitted: eager interpret mode is slower
    assert_matches(case, out, reference.ragged_paged_mla_attention(*args, **kwargs), seed)


# DeepSeek-V3's attention per GPU: 128 heads (16 at tensor parallel 8), latent 512, rope 64.
V3 = dict(num_heads=128, latent=512, rope_dim=64, page_size=64, config=MlaConfig())
LOWERING_CASES = [
    Case("v3_decode", (1,) * 4, (300, 4000, 64, 1), **V3),  # type: ignore[arg-type]
    Case("v3_mixed", (100, 1), (612, 70), **V3),  # type: ignore[arg-type]
    Case("v3_decode_fp8", (1,) * 4, (300, 4000, 64, 1), cache_dtype="float8_e4m3fn",
         **V3),  # type: ignore[arg-type]
    Case("v3_tp8_prefill", (256,), (256,), **V3 | dict(num_heads=16)),  # type: ignore[arg-type]
]  # fmt: skip


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize(
    ("case", "device_kind"),
    [(case, "NVIDIA H200") for case in LOWERING_CASES]
    + [(case, "NVIDIA A100") for case in LOWERING_CASES if case.cache_dtype == "bfloat16"],
    ids=lambda x: x.name if isinstance(x, Case) else x.split()[-1],
)
def test_lowers_to_triton_at_deepseek_v3_shapes(case, device_kind, verify_triton_modules) -> None:
    """The Pallas -> Triton IR lowering of the real shapes (576-wide q tiles, 64-head blocks,
    fp8 tiles converted on the H200; an A100 converts no e4m3, dispatch sends it to the
    reference) runs on the CPU; only ptxas is left for the GPU."""
    args = make_inputs(np.random.default_rng(0), case)
    kwargs = attention_kwargs(case)
    gpu = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(lambda *a: ragged_paged_mla_attention(*a, **kwargs)).trace(*args)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_config_and_shapes_are_validated() -> None:
    with pytest.raises(ValueError, match="block_kv=48 must be a power of two >= 16"):
        MlaConfig(block_kv=48)
    with pytest.raises(ValueError, match="block_h=3 must be a power of two >= 1"):
        MlaConfig(block_h=3)
    with pytest.raises(ValueError, match="num_warps=3 must be 1, 2, 4, 8 or 16"):
        MlaConfig(num_warps=3)
    args = make_inputs(np.random.default_rng(0), Case("rope12", (1,), (5,), rope_dim=12))
    assert "qk_rope_head_dim=12" in (unsupported_reason(*args[:4]) or "")
    with pytest.raises(ValueError, match="qk_rope_head_dim=12: the kernel takes multiples of 8"):
        ragged_paged_mla_attention(*args, sm_scale=0.1, interpret=True)
    q32 = args[0].astype(jnp.float32)
    assert "query dtype float32" in (unsupported_reason(q32, args[1], *args[2:4]) or "")


def test_dispatch_follows_the_environment(monkeypatch) -> None:
    """On the CPU: the reference by default and with ``off``, the kernel in interpret mode with
    ``on`` or ``interpret``; the reference where the kernel does not take the shapes."""
    case = Case("d", (1,), (5,))
    args = make_inputs(np.random.default_rng(0), case)[:4]
    assert dispatch.choose(*args) == (
        "reference",
        "the MLA kernels are for GPUs and TPUs; this is the cpu backend",
    )
    monkeypatch.setenv("JAXSERVE_MLA", "on")
    assert dispatch.choose(*args)[0] == "interpret"
    q32 = args[0].astype(jnp.float32)
    path, why = dispatch.choose(q32, *args[1:])
    assert path == "reference" and "query dtype float32" in why
    monkeypatch.setenv("JAXSERVE_MLA", "off")
    assert dispatch.choose(*args) == ("reference", "JAXSERVE_MLA=off")
    monkeypatch.setenv("JAXSERVE_MLA", "Interpret")
    assert dispatch.choose(*args) == (
        "interpret",
        "JAXSERVE_MLA=interpret, Pallas interpret mode on the cpu backend",
    )
    line = dispatch.describe(16, 512, 64, jnp.bfloat16, jnp.float8_e4m3fn)
    assert line == (
        "Attention: Pallas Triton MLA kernel in interpret mode (multi-head latent attention: "
        "JAXSERVE_MLA=interpret, Pallas interpret mode on the cpu backend)"
    )
    monkeypatch.setenv("JAXSERVE_MLA", "fast")
    with pytest.raises(ValueError, match="JAXSERVE_MLA='fast' must be one of auto, on, "):
        dispatch.choose(*args)


def test_the_model_calls_the_kernel_through_the_dispatch(monkeypatch) -> None:
    """A DeepSeek-V3-shaped layer (bf16, rope 16) runs a prompt through ``mla_attention_block``
    (latent written, then read) with ``JAXSERVE_MLA=interpret`` as with ``off``."""
    config = model_config_from_dict(TINY_V3)
    rng = np.random.default_rng(1)

    def weight(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape) * 0.3, jnp.bfloat16)

    hidden, heads = config.hidden_size, config.num_q_heads  # 64, 4
    lw = LayerWeights(  # a plain q_proj (no q_lora_rank); nope 16, rope 16, latent 32, value 12
        attn_norm=weight(hidden), wq=weight(hidden, heads, 32), wo=weight(heads, 12, hidden),
        mlp_norm=weight(hidden), wkv_a=weight(hidden, 32), wk_pe=weight(hidden, 16),
        kv_a_norm=weight(32) + 1, w_kv_b=weight(32, heads, 28),
    )  # fmt: skip
    x = jnp.asarray(rng.normal(size=(11, config.hidden_size)), jnp.bfloat16)
    pages, pos = np.asarray([4, 1, 5], np.int32), np.arange(11, dtype=np.int32)
    batch = Batch(
        input_ids=jnp.zeros(11, jnp.int32),
        positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(pages[pos // 4] * 4 + pos % 4),
        kv_lens=jnp.asarray([11], jnp.int32),
        page_indices=jnp.asarray(pages[None]),
        cu_q_lens=jnp.asarray([0, 11], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        logits_indices=jnp.asarray([10], jnp.int32),
    )
    freqs, scale = rope.rotary_angles(
        batch.positions, config.head_dim, config.rope_theta, config.rope_scaling
    )
    rotary = rope.cos_sin(freqs, scale, jnp.bfloat16)
    cache = tuple(jnp.zeros((6, 4, *dims), jnp.bfloat16) for dims in config.kv_cache_dims)

    def run(mode: str) -> np.ndarray:
        monkeypatch.setenv("JAXSERVE_MLA", mode)  # read when the block is traced
        block = jax.jit(functools.partial(mla.mla_attention_block, config=config))
        out, *_ = block(lw, x, *cache, batch, rotary=rotary)
        return np.asarray(out, np.float32)

    kernel, want = run("interpret"), run("off")
    top = np.abs(want).max()  # bf16 rounding differs after the output projections
    assert top > 0.1
    np.testing.assert_allclose(kernel, want, atol=0.02 * top, rtol=0.02)


TINY_V3 = dict(
    model_type="deepseek_v3", vocab_size=320, hidden_size=64, intermediate_size=32,
    moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
    kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=12,
)  # fmt: skip


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def _gpu_cases() -> list[Case]:
    rng = np.random.default_rng(7)
    ragged = tuple(int(x) for x in rng.integers(1, 5000, 32))
    return CPU_CASES + [
        Case("v3_decode_b1_32k", (1,), (32768,), **V3),  # type: ignore[arg-type]
        Case("v3_decode_ragged", (1,) * 32, ragged, num_pad_tokens=5, num_dead_slots=3,
             **V3),  # type: ignore[arg-type]
        Case("v3_decode_fp8", (1,) * 32, ragged, cache_dtype="float8_e4m3fn",
             **V3),  # type: ignore[arg-type]
        Case("v3_mixed_chunked", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64),
             num_pad_tokens=11, **V3),  # type: ignore[arg-type]
        Case("v3_prefill_2048", (2048,), (2048,), **V3),  # type: ignore[arg-type]
        Case("v3_tp8_heads16_mixed", (300, 1, 1), (1200, 700, 33),
             **V3 | dict(num_heads=16)),  # type: ignore[arg-type]
        Case("v3_page16_split4", (1,) * 6, ragged[:6], **V3 | dict(
            page_size=16, config=MlaConfig(num_splits=4))),  # type: ignore[arg-type]
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c.name)
def test_native_matches_reference(case: Case) -> None:
    """Natively on the GPU, NaN left in the allocator and aliased to the output first."""
    seed = int(np.random.default_rng().integers(2**31))
    args = make_inputs(np.random.default_rng(seed), case)
    kwargs = attention_kwargs(case)
    ref = reference_compiled_plainly(
        lambda *a: reference.ragged_paged_mla_attention(*a, **kwargs), *args
    )
    out = _poisoned_run(
        lambda *a: ragged_paged_mla_attention(*a, **kwargs, config=case.config),
        args,
        ref.shape,
        ref.dtype,
    )
    assert_matches(case, out, ref, seed)


TENSOR_PARALLEL_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    os.environ["JAXSERVE_MLA"] = sys.argv[1]
    import jaxserve
    from jaxserve import SamplingParams
    from pallas_kernels.mla import triton
    heads_seen = set()  # the query heads of each kernel call (per device under a shard_map)
    kernel = triton.ragged_paged_mla_attention
    def counted(q_latent, *args, **kwargs):
        heads_seen.add(q_latent.shape[1])
        return kernel(q_latent, *args, **kwargs)
    triton.ragged_paged_mla_attention = counted
    tp = int(sys.argv[2])
    llm = jaxserve.LLM("tests/fixtures/models/deepseek_v3", tensor_parallel_size=tp,
                       max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=4,
                       num_gpu_blocks_override=32, dtype="bfloat16", warmup=False)
    golden = np.load("tests/fixtures/models/deepseek_v3/golden.npz")
    prompt = {"prompt_token_ids": golden["prompt2_ids"].tolist()[:20]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    print(json.dumps({"tokens": list(out.token_ids), "heads": sorted(heads_seen)}), flush=True)
""")


def test_tensor_parallel_runs_the_kernel_on_each_devices_heads() -> None:
    """The DeepSeek-V3 fixture (4 heads, latent 32, rope 8) in bf16 on 2 virtual CPU devices
    with ``JAXSERVE_MLA=interpret``: the kernel runs inside the heads' shard_map on 2 heads a
    device over the whole latent cache, and the greedy tokens are those of one device (the
    kernel on 4 heads) and of the reference."""
    runs = {
        (mode, tp): json.loads(run_with_devices(TENSOR_PARALLEL_SCRIPT, 2, mode, str(tp)))
        for mode, tp in [("interpret", 2), ("interpret", 1), ("off", 1)]
    }
    assert runs["interpret", 2]["heads"] == [2]
    assert runs["interpret", 1]["heads"] == [4]
    assert runs["off", 1]["heads"] == []
    tokens = runs["off", 1]["tokens"]
    assert len(tokens) == 6
    assert runs["interpret", 2]["tokens"] == runs["interpret", 1]["tokens"] == tokens
