"""The Mosaic GPU (Hopper wgmma) multi-head latent attention kernel against the reference.

On CPU (CI): the kernel in Mosaic GPU interpret mode, with the race detector, on tiny shapes
(latent 128, rope 32 or 16, 16 or 8 heads): a decode-only batch unsplit over page size 16 and a
mixed prefill / decode ragged batch split over page size 64, fresh random inputs each run.
Interpret mode runs a program's 3 warpgroups as threads that block in host callbacks, which
needs an XLA CPU client of 4 threads (``mosaic_gpu.interpreter_unsupported_reason``): the grid
runs in one process of its own with ``NPROC=4``. At DeepSeek-V3's shapes (128 heads and a TP-8
shard's 16, latent 512, rope 64, page 64) the kernel goes through Mosaic GPU's real lowering
for CUDA (layouts, wgmma and TMA shapes, 227 KB of shared memory), decode and a 2,048-token
prefill; registers are not checked there. The ``gpu`` tests run the grid natively on a Hopper
GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import dispatch, mosaic_gpu, reference
from pallas_kernels.mla.mosaic_gpu import MlaMosaicConfig
from tests.conftest import reference_compiled_plainly, run_with_devices
from tests.test_kernel_gpu import _poisoned_run
from tests.test_mla_kernel import Case as TritonCase
from tests.test_mla_kernel import make_inputs


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]  # new tokens per live sequence
    kv_lens: tuple[int, ...]  # cached tokens per live sequence, the new ones included
    num_heads: int = 16
    latent: int = 128
    rope_dim: int = 32
    page_size: int = 16
    num_pad_tokens: int = 0  # rows past the last sequence's (a token bucket's padding)
    num_dead_slots: int = 0  # page-table rows past num_seqs
    config: MlaMosaicConfig = MlaMosaicConfig()

    def inputs(self, seed: int) -> tuple[jax.Array, ...]:
        """``test_mla_kernel.make_inputs``'s batch: bf16 queries and cache, shuffled pages."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["config"]
        return make_inputs(np.random.default_rng(seed), TritonCase(**fields))

    def kwargs(self) -> dict:
        return dict(sm_scale=(self.latent + self.rope_dim) ** -0.5)


CPU_CASES = [
    # Decodes (3 steps of 64 at 140 tokens: both consumers own steps, a slot refilled), a
    # padding row, a dead page-table row; 4 pages of 16 a step, past the sequence zero-filled.
    Case("decode_b3_page16", (1, 1, 1), (5, 140, 23), num_pad_tokens=1, num_dead_slots=1),
    # A mixed ragged step split two ways over page 64, rope 16, 8 heads (8 tokens x 8 heads a
    # program): a decode at 330 (3 steps a split), a 9-token chunk of a 25-token prompt (tiles
    # of 8 and 1 tokens, masked causally), a decode at 12.
    Case("mixed_split2_page64", (1, 9, 1), (330, 25, 12), num_heads=8, rope_dim=16,
         page_size=64, num_pad_tokens=2, config=MlaMosaicConfig(num_splits=2)),
    # Latent 256: the scores' loop over the latent in two chunks of 128 (_scores), 2 steps;
    # and as one unrolled wgmma (latent_chunk 256, the form before).
    Case("decode_latent256", (1, 1), (70, 130), num_heads=8, latent=256, rope_dim=16),
    Case("decode_latent256_unrolled", (1, 1), (70, 130), num_heads=8, latent=256, rope_dim=16,
         config=MlaMosaicConfig(latent_chunk=256)),
]  # fmt: skip


INTERPRET_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from pallas_kernels.mla import mosaic_gpu, reference
    from tests.test_mla_mosaic_gpu import CPU_CASES, compare
    seed = int(sys.argv[1])
    for case in CPU_CASES:
        args, kwargs = case.inputs(seed), case.kwargs()
        params = plgpu.InterpretGPUParams(detect_races=True)
        out = mosaic_gpu.ragged_paged_mla_attention(
            *args, **kwargs, config=case.config, interpret=params)
        ref = reference.ragged_paged_mla_attention(*args, **kwargs)
        print(json.dumps({"name": case.name, "error": compare(case, out, ref)}), flush=True)
""")


def compare(case: Case, out: jax.Array, ref: jax.Array) -> str | None:
    """None when the live rows match within bf16 tolerance (the probabilities meet the latent
    in bf16) and the padding rows are exact zeros; else what differs."""
    live = int(sum(case.q_lens))
    got, want = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"{out.shape} {out.dtype} against {ref.shape} {ref.dtype}"
    if got[live:].any():
        return "padding rows written"
    if not np.allclose(got[:live], want[:live], atol=2e-2, rtol=2e-2):
        return f"max |difference| {np.abs(got[:live] - want[:live]).max():.4f}"
    return None


@pytest.fixture(scope="module")
def interpreted() -> tuple[int, dict, str]:
    """(seed, case name -> error or None, the run's output): the grid in one process whose XLA
    CPU client has 4 threads, with the race detector."""
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NPROC", str(mosaic_gpu.INTERPRETER_THREADS))
        out = run_with_devices(INTERPRET_SCRIPT, 1, str(seed), timeout=300)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return seed, {row["name"]: row["error"] for row in rows}, out


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case, interpreted) -> None:
    seed, errors, out = interpreted
    assert case.name in errors, out[-2000:]
    assert errors[case.name] is None, f"{case.name} (seed {seed}): {errors[case.name]}"
    assert "RACE DETECTED" not in out


def abstract_inputs(q_lens, kv_lens, num_heads: int, page_size: int = 64) -> tuple:
    """DeepSeek-V3's shapes (latent 512, rope 64, bf16) as ShapeDtypeStructs: lowering needs
    no data."""
    num_seqs, pages_per_seq = len(q_lens), -(-max(kv_lens) // page_size)
    num_tokens, num_pages = sum(q_lens), num_seqs * pages_per_seq
    shape, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    return (
        shape((num_tokens, num_heads, 512), bf16),
        shape((num_tokens, num_heads, 64), bf16),
        shape((num_pages, page_size, 1, 512), bf16),
        shape((num_pages, page_size, 1, 64), bf16),
        shape((num_seqs,), i32),
        shape((num_seqs, pages_per_seq), i32),
        shape((num_seqs + 1,), i32),
        shape((1,), i32),
    )


LOWERING_CASES = {
    # 4 decodes: 2 head blocks of 64, the KV split (default: the programs fill few SMs).
    "v3_decode": ((1,) * 4, (300, 4000, 64, 1), 128, None),
    "v3_tp8_decode_unsplit": ((1,) * 4, (300, 4000, 64, 1), 16, 1),  # 16 of 64 rows
    "v3_prefill_2048": ((2048,), (2048,), 128, None),  # a token x 64 heads a program
    "v3_tp8_prefill_2048": ((2048,), (2048,), 16, None),  # 4 tokens x 16 heads
}


@pytest.mark.parametrize("name", LOWERING_CASES)
def test_lowers_for_cuda_at_deepseek_v3_shapes(name: str) -> None:
    """Mosaic GPU's lowering (layout inference, wgmma and TMA checks, the shared memory limit)
    runs on the CPU; ptxas and the registers are left for the GPU."""
    q_lens, kv_lens, num_heads, num_splits = LOWERING_CASES[name]
    args = abstract_inputs(q_lens, kv_lens, num_heads)
    config = MlaMosaicConfig(num_splits=num_splits)
    call = functools.partial(
        mosaic_gpu.ragged_paged_mla_attention, sm_scale=576**-0.5, config=config
    )
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_shared_memory_and_shapes_are_checked() -> None:
    args = abstract_inputs((1,), (64,), 128)
    assert mosaic_gpu.unsupported_reason(*args[:4]) is None
    # DeepSeek-V3 at the default blocking: 225 KB of the 227 KB (a split's f32 output fits
    # in the ring).
    assert mosaic_gpu.smem_bytes(512, 64, 2, 64, 2, is_split=True) <= mosaic_gpu.SMEM_BYTES
    reason = mosaic_gpu.unsupported_reason(*args[:4], MlaMosaicConfig(num_stages=3))
    assert reason is not None and "shared memory" in reason
    fp8 = jax.ShapeDtypeStruct(args[2].shape, jnp.float8_e4m3fn)
    assert "query's dtype" in (mosaic_gpu.unsupported_reason(args[0], args[1], fp8, args[3]) or "")
    heads12 = jax.ShapeDtypeStruct((1, 12, 512), jnp.bfloat16)
    assert "multiples of 8" in (mosaic_gpu.unsupported_reason(heads12, *args[1:4]) or "")
    with pytest.raises(ValueError, match="block_kv=32 must be 64 or 128"):
        MlaMosaicConfig(block_kv=32)
    # The scores' loop takes whole chunks of the latent: 512 in 192s would drop 128 columns.
    reason = mosaic_gpu.unsupported_reason(*args[:4], MlaMosaicConfig(latent_chunk=192))
    assert reason == "latent_chunk=192 does not divide kv_lora_rank=512"
    assert mosaic_gpu.unsupported_reason(*args[:4], MlaMosaicConfig(latent_chunk=1024)) is None
    with pytest.raises(ValueError, match="latent_chunk=96 must be a multiple of 64"):
        MlaMosaicConfig(latent_chunk=96)


def test_kv_splits_count_one_program_an_sm(monkeypatch) -> None:
    """The kernel's shared memory holds one program an SM: a decode of 64 sequences at 128
    heads (128 programs) fills the H100's / H200's 132 SMs unsplit (split in two it ran 13%
    slower); 32 sequences (64 programs) split in two; one sequence splits its 4,096 tokens 32
    ways (2 head blocks, 64 programs; two KV steps a split)."""
    monkeypatch.setattr(mosaic_gpu, "num_sms", lambda: 132)

    def launch(num_seqs: int) -> tuple[int, int]:
        args = abstract_inputs((1,) * num_seqs, (4096,) * num_seqs, 128)
        found = mosaic_gpu._launch_for(args[0], args[2], args[5], MlaMosaicConfig())
        return found.max_tiles * found.num_head_blocks, found.num_splits

    assert launch(64) == (128, 1)
    assert launch(32) == (64, 2)
    assert launch(1) == (2, 32)


def test_auto_takes_the_mosaic_kernel_on_hopper_and_the_triton_kernel_elsewhere(
    monkeypatch,
) -> None:
    """``auto`` on a GPU: the Mosaic GPU kernel on Hopper (a GPU named from a host without one
    counts as Hopper: ``--device-memory H200``), the Triton kernel where the GPU is not Hopper
    or the Mosaic GPU kernel does not take the shapes (an fp8 cache), each with its reason;
    the reference on the CPU."""
    args = abstract_inputs((1,), (64,), 16)[:4]
    assert dispatch.choose(*args)[0] == "reference"
    assert dispatch.choose(*args, backend="gpu") == ("mosaic", "JAXSERVE_MLA=auto on a Hopper GPU")
    assert dispatch.path_for(16, 512, 64, jnp.bfloat16, jnp.bfloat16, 8, "gpu") == (
        "mosaic",
        "JAXSERVE_MLA=auto on a Hopper GPU, 16 heads a device under a shard_map",
    )
    fp8 = [jax.ShapeDtypeStruct(a.shape, jnp.float8_e4m3fn) for a in args[2:]]
    path, why = dispatch.choose(*args[:2], *fp8, backend="gpu")
    assert path == "triton" and why.startswith("JAXSERVE_MLA=auto on an NVIDIA GPU; the Mosaic")
    assert "fp8" in why or "float8" in why
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: False)
    assert dispatch.choose(*args, backend="gpu") == (
        "triton",
        "JAXSERVE_MLA=auto on an NVIDIA GPU; the Mosaic GPU MLA kernel does not run this model "
        "(it needs a Hopper GPU (wgmma, compute capability 9.x))",
    )


def test_dispatch_takes_the_mosaic_kernel_when_asked(monkeypatch) -> None:
    """``mosaic`` takes the Mosaic GPU kernel where it runs (interpret mode off a GPU, given the
    threads), else what ``on`` takes, with the reason."""
    args = abstract_inputs((1,), (64,), 16)[:4]
    monkeypatch.setenv("JAXSERVE_MLA", "mosaic")
    assert dispatch.choose(*args, backend="gpu") == ("mosaic", "JAXSERVE_MLA=mosaic")
    assert dispatch.path_for(16, 512, 64, jnp.bfloat16, jnp.bfloat16, 8, "gpu")[0] == "mosaic"
    monkeypatch.setenv("NPROC", "4")
    assert dispatch.choose(*args) == (
        "mosaic_interpret",
        "JAXSERVE_MLA=mosaic, Mosaic GPU interpret mode on the cpu backend",
    )
    line = dispatch.describe(16, 512, 64, jnp.bfloat16, jnp.bfloat16)
    assert line.startswith("Attention: Pallas Mosaic GPU MLA kernel in interpret mode (")
    monkeypatch.setenv("NPROC", "2")
    path, why = dispatch.choose(*args)
    assert path == "interpret" and "XLA CPU client's 2 threads" in why
    fp8 = [jax.ShapeDtypeStruct(a.shape, jnp.float8_e4m3fn) for a in args[2:]]
    path, why = dispatch.choose(*args[:2], *fp8, backend="gpu")
    assert path == "triton" and why.startswith("the Mosaic GPU MLA kernel does not run this")
    rope8 = jax.ShapeDtypeStruct((1, 16, 8), jnp.bfloat16)
    kpe8 = jax.ShapeDtypeStruct((1, 64, 1, 8), jnp.bfloat16)
    assert dispatch.choose(args[0], rope8, args[2], kpe8, backend="gpu")[0] == "triton"


def test_temporary_bytes_count_the_output_and_the_splits() -> None:
    """Decode at batch 1 splits (f32 partials and log-sum-exps); a 2,048-token step does not."""
    one = mosaic_gpu.temporary_bytes(1, 128, 512, 64, 64, 512, 2, 2)
    assert one > 128 * 512 * 2 * 2  # the output and at least two f32 partial outputs
    prefill = mosaic_gpu.temporary_bytes(2048, 16, 512, 64, 64, 2560, 2, 2)
    assert prefill == 2048 * 16 * 512 * 2


def _is_hopper() -> bool:
    device = jax.devices()[0]
    major = str(getattr(device, "compute_capability", "0")).split(".")[0]
    return device.platform == "gpu" and major == "9"


def _gpu_cases() -> list[Case]:
    rng = np.random.default_rng(7)
    ragged = tuple(int(x) for x in rng.integers(1, 5000, 32))
    v3 = dict(latent=512, rope_dim=64, page_size=64)
    return CPU_CASES + [
        Case("v3_decode_b1_32k", (1,), (32768,), num_heads=128, **v3),  # type: ignore[arg-type]
        Case("v3_decode_ragged", (1,) * 32, ragged, num_heads=128, num_pad_tokens=5,
             num_dead_slots=3, **v3),  # type: ignore[arg-type]
        Case("v3_decode_unsplit", (1,) * 32, ragged, num_heads=128,
             config=MlaMosaicConfig(num_splits=1), **v3),  # type: ignore[arg-type]
        Case("v3_mixed_chunked", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), num_heads=128,
             num_pad_tokens=11, **v3),  # type: ignore[arg-type]
        Case("v3_prefill_2048", (2048,), (2048,), num_heads=128, **v3),  # type: ignore[arg-type]
        Case("v3_tp8_heads16_mixed", (300, 1, 1), (1200, 700, 33), num_heads=16,
             **v3),  # type: ignore[arg-type]
        Case("v3_page16_split4", (1,) * 6, ragged[:6], num_heads=128,
             config=MlaMosaicConfig(num_splits=4), **v3 | dict(page_size=16)),  # type: ignore[arg-type]
        Case("v3_page128", (1, 40, 1), (1000, 40, 333), num_heads=128,
             **v3 | dict(page_size=128)),  # type: ignore[arg-type]
        Case("latent256_heads32_stages3", (1, 9, 1), (700, 25, 12), num_heads=32, latent=256,
             rope_dim=64, page_size=64, config=MlaMosaicConfig(num_stages=3)),
        Case("chunk_heads16_stages3", (20, 1), (150, 70), config=MlaMosaicConfig(num_stages=3)),
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90) NVIDIA GPU")
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c.name)
def test_native_matches_reference(case: Case) -> None:
    """Natively on the GPU, NaN left in the allocator and aliased to the output first."""
    seed = int(np.random.default_rng().integers(2**31))
    args, kwargs = case.inputs(seed), case.kwargs()
    ref = reference_compiled_plainly(
        lambda *a: reference.ragged_paged_mla_attention(*a, **kwargs), *args
    )
    out = _poisoned_run(
        lambda *a: mosaic_gpu.ragged_paged_mla_attention(*a, **kwargs, config=case.config),
        args,
        ref.shape,
        ref.dtype,
    )
    assert compare(case, out, ref) is None, f"{case.name} (seed {seed})"
