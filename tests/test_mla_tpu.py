"""The Mosaic TPU multi-head latent attention kernel against the pure-jnp reference, in TPU
interpret mode on the CPU.

The interpreter simulates HBM, VMEM, DMAs and DMA semaphores (copies land only when waited on,
fresh VMEM reads as NaN, the parallel grid axes are visited in a random order) and its race
detector checks each run, so a missing wait, a read of an unfetched page or a dependence between
programs shows up. Fresh random inputs every run (the seed is in the failure message). At
DeepSeek-V3's shapes the kernel is lowered to Mosaic MLIR for a TPU; nothing here compiles it
with Mosaic's backend or runs it on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# NOTE: the race detector's verdict is only exposed on this private module.
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mla import reference, tpu
from pallas_kernels.mla.tpu import MlaTpuConfig
from tests.test_mla_kernel import attention_kwargs, make_inputs


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]  # new tokens per live sequence
    kv_lens: tuple[int, ...]  # cached tokens per live sequence, the new ones included
    num_heads: int = 4
    latent: int = 128
    rope_dim: int = 32
    page_size: int = 16
    num_pad_tokens: int = 0  # rows past the last sequence's (a token bucket's padding)
    num_dead_slots: int = 0  # page-table rows past num_seqs
    cache_dtype: str = "bfloat16"  # or an fp8 dtype, with SCALES
    config: MlaTpuConfig = MlaTpuConfig(block_kv=32)  # several KV steps at tiny lengths


def check_against_reference(case: Case) -> None:
    """The kernel in TPU interpret mode (races checked) against the reference, within bf16
    tolerance; the padding rows exactly zero."""
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    args = make_inputs(np.random.default_rng(seed), case, spare_columns=1)
    kwargs = attention_kwargs(case)
    params = pltpu.InterpretParams(random_seed=seed, detect_races=True)
    call = functools.partial(
        tpu.ragged_paged_mla_attention, **kwargs, config=case.config, interpret=params
    )
    try:
        out = jax.block_until_ready(jax.jit(call)(*args))  # jitted: eager interpret is slower
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()  # as the interpreter asks after an error
        raise
    assert mosaic_interpret.races is not None and not mosaic_interpret.races.races_found
    ref = jax.jit(functools.partial(reference.ragged_paged_mla_attention, **kwargs))(*args)
    live = int(sum(case.q_lens))
    got, want = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(got[:live], want[:live], atol=2e-2, rtol=2e-2, err_msg=f"{seed=}")
    assert not got[live:].any(), f"padding rows not zero ({seed=})"


CASES = [
    # Decode-only, batch 3: a short context, a page-aligned one, an unaligned one over several
    # KV steps; a padding row and a dead slot.
    Case("decode_b3", (1, 1, 1), (5, 64, 75), num_pad_tokens=1, num_dead_slots=1),
    # Mixed: decodes beside a 9-token chunk of a prompt with 31 tokens cached; 2 tokens x 4
    # heads a program, the chunk in 5 tiles (the last one part full).
    Case("mixed_chunked", (1, 9, 1), (40, 40, 17), num_pad_tokens=3, num_dead_slots=1,
         config=MlaTpuConfig(block_kv=32, block_rows=8)),
    # A whole prompt and a decode at page size 64, latent 512, rope 64 (DeepSeek-V3's widths),
    # one page a KV step.
    Case("prefill_v3_widths_page64", (20, 1), (20, 130), latent=512, rope_dim=64,
         page_size=64, num_pad_tokens=2, config=MlaTpuConfig(block_kv=64, block_rows=16)),
    # The mix over an fp8 (e4m3) cache with per-tensor scales.
    Case("mixed_fp8_e4m3", (1, 6), (30, 22), num_pad_tokens=2, cache_dtype="float8_e4m3fn",
         config=MlaTpuConfig(block_kv=32, block_rows=8)),
    # 6 heads in blocks of 3 (two head blocks); rope 128, no lane padding.
    Case("heads6_block3_rope128", (1, 4), (33, 4), num_heads=6, rope_dim=128,
         config=MlaTpuConfig(block_h=3, block_rows=6, block_kv=16)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case) -> None:
    check_against_reference(case)


def test_tp8_shard_at_deepseek_v3_widths() -> None:
    """A TP-8 shard of DeepSeek-V3: 16 heads, latent 512, rope 64, 16-token pages, the
    default KV step and head block (one 16-head block a decode token), 4 tokens x 16 heads a
    prefill program (the default's 16 x 16 is lowered below: 16 row DMAs a program are slow
    to interpret); a decode beside a 5-token chunk of a prompt over an e5m2 cache."""
    case = Case("tp8", (1, 5), (40, 21), num_heads=16, latent=512, rope_dim=64,
                num_pad_tokens=1, cache_dtype="float8_e5m2",
                config=MlaTpuConfig(block_rows=64))  # fmt: skip
    check_against_reference(case)


# DeepSeek-V3's attention per device: 128 heads (16 at tensor parallel 8), latent 512, rope 64.
V3 = dict(latent=512, rope_dim=64, page_size=16, config=MlaTpuConfig())
LOWERING_CASES = [
    (Case("v3_decode", (1,) * 4, (300, 4000, 64, 1), num_heads=128, **V3), "TPU v5 lite"),
    (Case("v3_mixed_fp8", (100, 1), (612, 70), num_heads=128, cache_dtype="float8_e4m3fn",
          **V3), "TPU v6 lite"),
    (Case("v3_tp8_prefill", (256,), (256,), num_heads=16, **V3), "TPU7x"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "device_kind"), LOWERING_CASES, ids=lambda x: getattr(x, "name", x)
)
def test_lowers_to_mosaic_at_deepseek_v3_shapes(case: Case, device_kind: str) -> None:
    """The Pallas -> Mosaic lowering of the real shapes (a 128-head decode block, 2 tokens x
    128 heads and 16 x 16 prefill blocks, 16-page KV steps, an fp8 cache) for an abstract TPU
    runs on the CPU; Mosaic's own passes and the TPU are left."""
    shapes = [
        jax.ShapeDtypeStruct(x.shape, x.dtype)
        for x in make_inputs(np.random.default_rng(0), case, spare_columns=1)
    ]
    kwargs = attention_kwargs(case)
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(lambda *a: tpu.ragged_paged_mla_attention(*a, **kwargs)).trace(*shapes)
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "ragged_paged_mla_attention_tpu" in text


def test_vmem_budget_at_deepseek_v3_shapes() -> None:
    """A program's VMEM at DeepSeek-V3's widths (bf16; 16-token pages, 256 tokens a KV step)
    stays well inside the 16 MiB a Mosaic kernel gets by default (v5e's scoped limit)."""
    mib = 1 << 20
    for heads in (128, 16):
        decode = tpu.vmem_bytes(64, heads, 512, 64, 16, 2048, 2, 2, num_slots=64)
        prefill = tpu.vmem_bytes(2048, heads, 512, 64, 16, 2048, 2, 2, num_slots=1)
        fp8 = tpu.vmem_bytes(64, heads, 512, 64, 16, 2048, 1, 2, num_slots=64)
        assert fp8 < decode <= prefill < 4 * mib, (heads, decode, prefill, fp8)
    # The output and the tile plan: 2,048 x 16 x 512 x 2 bytes, plus 80 KiB.
    assert tpu.temporary_bytes(2048, 16, 512, 64, 16, 2048, 2, 2) == 2048 * 16 * 1024 + 81920


def test_unsupported_shapes_name_their_field() -> None:
    def shapes(**fields) -> list[jax.ShapeDtypeStruct]:
        case = Case("x", (1,), (5,), **fields)
        args = make_inputs(np.random.default_rng(0), case)[:4]
        return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]

    assert tpu.unsupported_reason(*shapes(latent=512, rope_dim=64)) is None
    assert "page_size=8" in (tpu.unsupported_reason(*shapes(page_size=8)) or "")
    assert "kv_lora_rank=96" in (tpu.unsupported_reason(*shapes(latent=96)) or "")
    assert "qk_rope_head_dim=12" in (tpu.unsupported_reason(*shapes(rope_dim=12)) or "")
    q, *rest = shapes()
    q16 = jax.ShapeDtypeStruct(q.shape, jnp.float16)
    assert "query dtype float16" in (tpu.unsupported_reason(q16, *rest) or "")
    args = make_inputs(np.random.default_rng(0), Case("p8", (1,), (5,), page_size=8))
    with pytest.raises(ValueError, match="page_size=8: the TPU kernel takes multiples of 16"):
        tpu.ragged_paged_mla_attention(*args, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="block_kv=0 must be >= 1"):
        MlaTpuConfig(block_kv=0)


def test_the_dispatch_takes_the_tpu_kernel_on_a_tpu(monkeypatch) -> None:
    """``JAXSERVE_MLA=auto`` on a TPU: the Mosaic TPU kernel where it takes the shapes (one
    device, or a shard_map's heads), the reference with the kernel's reason where not; the
    capacity plan for a named TPU reserves the kernel's temporaries."""
    from pallas_kernels.mla import dispatch

    monkeypatch.delenv("JAXSERVE_MLA", raising=False)
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    bf16 = jnp.bfloat16
    assert dispatch.path_for(128, 512, 64, bf16, bf16, backend="tpu") == (
        "tpu",
        "JAXSERVE_MLA=auto on a TPU",
    )
    path, why = dispatch.path_for(16, 512, 64, bf16, jnp.float8_e4m3fn, 8, backend="tpu")
    assert (path, why) == ("tpu", "JAXSERVE_MLA=auto on a TPU, 16 heads a device under a shard_map")
    path, why = dispatch.path_for(128, 96, 64, bf16, bf16, backend="tpu")  # latent not x128
    assert path == "reference" and "Mosaic TPU MLA kernel does not run" in why
    assert "kv_lora_rank" in why
    from jaxserve.runner.capacity import MLA_PATH_NAMES, MLA_TEMPORARY_BYTES

    assert MLA_TEMPORARY_BYTES["tpu"] is tpu.temporary_bytes
    assert MLA_PATH_NAMES["tpu"] == "Pallas Mosaic TPU kernel"
