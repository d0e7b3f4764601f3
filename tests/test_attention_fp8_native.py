"""The Mosaic GPU attention kernel's fp8 wgmma path (``KernelConfig(fp8_wgmma=True)``,
``JAXSERVE_FP8_ATTENTION=native``) against the reference over the same quantized queries.

The path rounds each query row to e4m3 at its own scale (``reference.quantize_queries`` does the
same in jnp) and the softmax probabilities P, times 256, to e4m3 inside the online softmax. The
oracle is the reference run over the quantized-and-dequantized queries ("the same scales"), so
what remains is P's rounding: e4m3 keeps 3 mantissa bits, an error of at most 2^-4 of each
normal probability, and the row-sum adds the unrounded P, so each output element may differ from
the oracle by at most 2^-4 times the attention-weighted mean of |v| (``weighted_abs_v``), plus
bf16's rounding of both results. ``assert_native_matches`` holds the kernel to that bound and,
over the whole output, to a relative (Frobenius) error under 4%. Seen in interpret mode on this
file's CPU cases and one of 190-300-token contexts (3 seeds each): 1.5-2.1% relative, and
element-wise at most 0.69 of P's bound.

Against the unquantized reference (what the convert path matches to bf16 rounding: 0.16-0.22%
on the same inputs) the native path's errors seen were 2.3-3.3% relative (Frobenius); the tests
hold them under 6%, so that a wrong scale cannot hide behind the oracle.

On CPU (CI) the kernel runs in Mosaic GPU interpret mode on tiny shapes, and lowers for CUDA at
Llama-3-8B's attention shape (the layout inference and register lowering of the fp8 wgmmas, the
quantization and the V transpose). The ``gpu`` tests run it natively on a Hopper GPU.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention import dispatch, mosaic_gpu, reference
from tests.test_kernel_gpu import (
    _RAGGED,
    Case,
    _is_hopper,
    _poisoned_run,
    attention_kwargs,
    make_inputs,
    make_sinks,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
P_ROUNDING = 2.0**-4  # e4m3's largest relative rounding error of a normal value
SAME_SCALES_REL = 0.04
UNQUANTIZED_REL = 0.06


def native_call(case: Case, *, interpret, **config):
    cfg = mosaic_gpu.KernelConfig(num_splits=case.num_splits, fp8_wgmma=True, **config)

    def call(q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, **sinks):
        return mosaic_gpu.ragged_paged_attention(
            q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs,
            **attention_kwargs(case), **sinks, config=cfg, interpret=interpret,
        )  # fmt: skip

    return call


def same_scales_reference(args, case: Case, sinks: dict) -> jax.Array:
    """The reference over the queries the kernel multiplies: each row rounded to e4m3 at its
    own scale and multiplied back (``reference.quantize_queries``); q's dtype out."""
    q = args[0]
    out = reference.ragged_paged_attention(
        reference.quantize_queries(q), *args[1:], **attention_kwargs(case), **sinks
    )
    return out.astype(q.dtype)


def weighted_abs_v(args, case: Case, sinks: dict) -> np.ndarray:
    """Each row's attention-weighted mean of |v| (the same weights): the scale of P's rounding
    error in that row's output."""
    q, k, v, *rest = args
    out = reference.ragged_paged_attention(
        reference.quantize_queries(q), k, jnp.abs(v), *rest, **attention_kwargs(case), **sinks
    )
    return np.asarray(out, np.float32)


def errors(out, want) -> tuple[float, float]:
    """(relative Frobenius error, largest absolute error)."""
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(out - want) / np.linalg.norm(want)), float(np.abs(out - want).max())


def assert_native_matches(case: Case, out, args, sinks: dict, seed: int = -1) -> None:
    """P's rounding bound element-wise against the same-scales oracle, the relative errors
    against it and against the unquantized reference, zeros on padding rows, no NaN."""
    what = f"{case.name} (seed {seed})"
    out = np.asarray(out, np.float32)
    want = np.asarray(same_scales_reference(args, case, sinks), np.float32)
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    num_live = sum(case.q_lens)
    np.testing.assert_array_equal(out[num_live:], 0.0, err_msg=f"{what}: padding rows")
    # P's rounding, bf16's rounding of both outputs (2^-9 each), and 1e-3 for P's subnormals.
    bound = P_ROUNDING * weighted_abs_v(args, case, sinks) + 2.0**-8 * np.abs(want) + 1e-3
    excess = np.abs(out - want) - bound
    assert excess.max() <= 0.0, f"{what}: over P's rounding bound by {excess.max():.3e}"
    rel, _ = errors(out, want)
    assert rel < SAME_SCALES_REL, f"{what}: relative error {rel:.2e} against the same scales"
    plain = reference.ragged_paged_attention(*args, **attention_kwargs(case), **sinks)
    rel_plain, _ = errors(out, plain)
    assert rel_plain < UNQUANTIZED_REL, f"{what}: relative error {rel_plain:.2e} unquantized"


# Tiny shapes: interpret mode simulates every program and copy on the CPU.
CPU_CASES = [
    # Decodes beside prefill chunks over cached pages, padding rows and a dead slot; GQA 4.
    Case("mixed_g4_d128", (1, 17, 1, 5), (1, 40, 16, 21), 4, 1, 128, num_pad_tokens=3,
         num_dead_slots=1, kv_dtype=E4M3),
    # GQA 1 at head_dim 64 (64-byte swizzles), the KV range split in two, e5m2 pages (wgmma
    # mixes e4m3 Q and P with e5m2 K and V^T), a window, a soft cap and sinks (to the merge).
    Case("split_g1_d64_e5m2_window_softcap_sinks", (9, 1, 1), (70, 100, 9), 2, 2, 64,
         num_splits=2, sliding_window=40, soft_cap=30.0, kv_dtype=E5M2, k_scale=0.5,
         v_scale=2.0, has_sinks=True),
    # Decodes reading 128 KV tokens a step (native_block_kv's choice for decode launches):
    # P and V^T 128 wide, a sequence shorter than one step, one of three.
    Case("decode_g4_d128_bk128", (1, 1, 1), (300, 90, 129), 8, 2, 128, num_pad_tokens=2,
         kv_dtype=E4M3),
    # A prompt chunk over cached pages beside a decode, the KV range split in two, 128 a step
    # (masked blocks at either end of a split's range).
    Case("split_prompt_g4_d128_bk128", (20, 1), (170, 300), 8, 2, 128, num_splits=2,
         kv_dtype=E4M3),
]  # fmt: skip


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_the_same_scales_reference(case: Case, capfd):
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    rng = np.random.default_rng(seed)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    # The race detector also checks the ordering of the Q quantization, P and the V transpose
    # in shared memory against the TMA copies and the wgmmas.
    tiles = dict(block_kv=128) if case.name.endswith("bk128") else {}
    call = native_call(case, interpret=plgpu.InterpretGPUParams(detect_races=True), **tiles)
    assert_native_matches(case, call(*args, **sinks), args, sinks, seed)
    assert "RACE DETECTED" not in capfd.readouterr().out


def test_quantize_queries_scales_each_row_to_e4m3s_range():
    q = jnp.asarray([[[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], [[3e-3, 1e-3, -1e-3], [7.0, 7.0, 7.0]]])
    got = np.asarray(reference.quantize_queries(q))
    np.testing.assert_array_equal(got[0, 1], 0.0)  # a zero row stays zero (amax floored)
    # The largest magnitude of a row maps to 448, which e4m3 holds: it comes back (to f32).
    amax = np.abs(got).max(axis=-1)[[0, 1, 1], [0, 0, 1]]
    np.testing.assert_allclose(amax, [2, 3e-3, 7], rtol=1e-6)
    np.testing.assert_allclose(got, np.asarray(q), rtol=2.0**-4)


# Llama-3-8B's attention (32 query heads over 8 KV heads, head_dim 128, page 16): a decode
# bucket of 64 sequences and a prefill bucket (one long chunk beside decodes), split and not.
# (Short contexts: the lowering reads only the shapes, and the inputs are drawn at random.)
LLAMA_LOWERING = [
    Case("decode_b64", (1,) * 64, tuple(range(3, 323, 5)), 32, 8, 128, kv_dtype=E4M3),
    Case("prefill_512_split2", (497, 1, 1), (1200, 700, 33), 32, 8, 128, num_pad_tokens=13,
         num_splits=2, kv_dtype=E4M3),
]  # fmt: skip


def lowered_text(case: Case, **config) -> str:
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
        make_inputs(np.random.default_rng(0), case),
    )
    fn = jax.jit(native_call(case, interpret=False, **config))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case", LLAMA_LOWERING, ids=lambda c: c.name)
def test_native_path_lowers_for_cuda_at_llama_shapes(case: Case):
    """Cross-platform lowering on the CPU runs Mosaic GPU's layout inference and register
    lowering (not ptxas): both products are fp8 wgmmas (e4m3 Q and P; e5m2 pages mixed in),
    Q and P are rounded to e4m3 in registers, and V goes through the 16-bit transpose."""
    text = lowered_text(case)
    kv = "e4m3" if case.kv_dtype == E4M3 else "e5m2"
    wgmmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32\.f32\.\w+\.\w+)", text))
    assert wgmmas == {f"m64n64k32.f32.e4m3.{kv}", f"m64n128k32.f32.e4m3.{kv}"}, wgmmas
    assert "cvt.rn.satfinite.e4m3x2.f32" in text  # Q and P
    assert f"cvt.rn.f16x2.{kv}x2" in text and f"cvt.rn.satfinite.{kv}x2.f16x2" in text  # V
    assert "bf16" not in " ".join(wgmmas)


def test_native_path_lowers_with_other_tiles():
    """block_kv 128 (P and V^T in 128-byte swizzles) with three stages, head_dim 64 (Q and K in
    64-byte ones), GQA 8, e5m2 pages."""
    case = Case("tiles", (1, 9), (300, 140), 16, 2, 64, kv_dtype=E5M2)
    text = lowered_text(case, block_kv=128, num_stages=3)
    assert "m64n128k32.f32.e4m3.e5m2" in text and "m64n64k32.f32.e4m3.e5m2" in text


def test_shared_memory_of_the_native_path():
    """fp8 Q, stages, P and V^T: 64 KB at Llama's head_dim with the default tiles (104 KB when
    converting); a config over the limit is refused before lowering."""
    native = mosaic_gpu.smem_bytes(128, 2, 64, 2, kv_itemsize=1, fp8_wgmma=True)
    convert = mosaic_gpu.smem_bytes(128, 2, 64, 2, kv_itemsize=1)
    assert (native, convert) == (64 * 1024, 104 * 1024)
    case = Case("smem", (1,), (20,), 2, 1, 128, kv_dtype=E4M3)
    args = make_inputs(np.random.default_rng(0), case)
    config = mosaic_gpu.KernelConfig(block_kv=256, num_stages=4, fp8_wgmma=True)
    with pytest.raises(ValueError, match=r"num_stages=4 \(fp8 wgmma\) needs 327,680 bytes"):
        mosaic_gpu.ragged_paged_attention(
            *args, **attention_kwargs(case), config=config, interpret=True
        )


@pytest.fixture
def on_hopper(monkeypatch):
    """The dispatch as on a Hopper GPU, the kernel replaced by a recorder of its config."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper_or_newer", lambda: True)
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    monkeypatch.delenv(dispatch.FP8_ATTENTION_ENV, raising=False)
    monkeypatch.delenv(mosaic_gpu.ISSUE_NEXT_ENV, raising=False)
    monkeypatch.delenv(mosaic_gpu.LEAN_REGISTERS_ENV, raising=False)
    configs = []

    def record(q, *args, config=mosaic_gpu.KernelConfig(), **kwargs):
        configs.append(config)
        return jnp.zeros_like(q)

    monkeypatch.setattr(mosaic_gpu, "ragged_paged_attention", record)
    return configs


@pytest.mark.parametrize(
    ("env", "kv_dtype", "batch_invariant", "want"),
    [(None, E4M3, False, mosaic_gpu.KernelConfig(fp8_wgmma=True, block_kv=128)),
     ("convert", E4M3, False, mosaic_gpu.KernelConfig()),
     ("Native", E5M2, True, mosaic_gpu.KernelConfig(num_splits=1, fp8_wgmma=True)),
     ("native", jnp.bfloat16, False, mosaic_gpu.KernelConfig()),
     ("convert", E4M3, True, mosaic_gpu.KernelConfig(num_splits=1))],
)  # fmt: skip
def test_the_switch_sets_the_kernels_config(
    on_hopper, monkeypatch, env, kv_dtype, batch_invariant, want
):
    if env is not None:
        monkeypatch.setenv(dispatch.FP8_ATTENTION_ENV, env)
    case = dataclasses.replace(LLAMA_LOWERING[0], q_lens=(1, 1), kv_lens=(40, 3), kv_dtype=None)
    q, k, v, *rest = make_inputs(np.random.default_rng(0), case)
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    dispatch.ragged_paged_attention(q, k, v, *rest, sm_scale=0.1, batch_invariant=batch_invariant)
    assert on_hopper == [want]


@pytest.mark.parametrize(("env", "want"), [(None, "end"), ("read", "read"), ("P", "p")])
def test_the_switch_sets_when_a_slots_next_copies_are_issued(on_hopper, monkeypatch, env, want):
    if env is not None:
        monkeypatch.setenv(mosaic_gpu.ISSUE_NEXT_ENV, env)
    case = dataclasses.replace(LLAMA_LOWERING[0], q_lens=(1, 1), kv_lens=(40, 3), kv_dtype=None)
    q, k, v, *rest = make_inputs(np.random.default_rng(0), case)
    for cache in (k.astype(E4M3), k):  # the native fp8 path and a bf16 cache
        dispatch.ragged_paged_attention(q, cache, cache, *rest, sm_scale=0.1)
    assert [config.issue_next for config in on_hopper] == [want, want]
    monkeypatch.setenv(mosaic_gpu.ISSUE_NEXT_ENV, "later")
    with pytest.raises(ValueError, match="JAXSERVE_ATTENTION_ISSUE_NEXT='later' must be one of"):
        dispatch.ragged_paged_attention(q, k, v, *rest, sm_scale=0.1)
    with pytest.raises(ValueError, match="issue_next='later' must be one of read, p, end"):
        mosaic_gpu.KernelConfig(issue_next="later")


@pytest.mark.parametrize(("env", "want"), [(None, False), ("on", True), ("OFF", False)])
def test_the_switch_sets_the_lean_register_forms(on_hopper, monkeypatch, env, want):
    if env is not None:
        monkeypatch.setenv(mosaic_gpu.LEAN_REGISTERS_ENV, env)
    case = dataclasses.replace(LLAMA_LOWERING[0], q_lens=(1, 1), kv_lens=(40, 3), kv_dtype=None)
    q, k, v, *rest = make_inputs(np.random.default_rng(0), case)
    dispatch.ragged_paged_attention(q, k.astype(E4M3), v.astype(E4M3), *rest, sm_scale=0.1)
    assert [config.lean_registers for config in on_hopper] == [want]


@pytest.mark.parametrize("when", ["read", "p"])
def test_copies_issued_earlier_in_the_step_match_too(when: str, capfd):
    """``issue_next`` "read" (before the softmax) and "p" (after P is stored) over fresh
    inputs: a 300-token sequence read 128 tokens a step, so its first slot is loaded again."""
    (case,) = [case for case in CPU_CASES if case.name == "decode_g4_d128_bk128"]
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    races = plgpu.InterpretGPUParams(detect_races=True)
    call = native_call(case, interpret=races, issue_next=when, block_kv=128)
    assert_native_matches(case, call(*args, **sinks), args, sinks, seed)
    assert "RACE DETECTED" not in capfd.readouterr().out


@pytest.mark.parametrize(
    ("tokens", "context", "env", "want"),
    [(64, 4096, None, 128),  # decode at batch 64: one split
     (512, 1536, None, 128),  # the full card's decode step
     (16, 4096, None, 64),  # a small batch: its KV range split
     (2048, 4096, None, 64),  # a step with a prompt
     (16, 4096, "128", 128), (64, 4096, "64", 64)],
)  # fmt: skip
def test_the_native_path_reads_128_tokens_a_step_in_unsplit_decode_launches(
    monkeypatch, tokens, context, env, want
):
    if env is None:
        monkeypatch.delenv(mosaic_gpu.FP8_BLOCK_KV_ENV, raising=False)
    else:
        monkeypatch.setenv(mosaic_gpu.FP8_BLOCK_KV_ENV, env)
    q = jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16)
    k_pages = jax.ShapeDtypeStruct((4096, 16, 8, 128), E4M3)
    page_indices = jax.ShapeDtypeStruct((min(tokens, 512), context // 16), jnp.int32)
    assert mosaic_gpu.native_block_kv(q, k_pages, page_indices) == want


@pytest.mark.parametrize(
    ("env", "kv_dtype", "want"),
    [(None, E4M3, "fp8 wgmmas, queries and probabilities in e4m3: JAXSERVE_FP8_ATTENTION=native"),
     ("convert", E5M2, "fp8 cache converted to bf16 in shared memory: "
      "JAXSERVE_FP8_ATTENTION=convert"),
     ("native", jnp.bfloat16, None)],
)  # fmt: skip
def test_choose_kernel_names_the_fp8_path(on_hopper, monkeypatch, env, kv_dtype, want):
    if env is not None:
        monkeypatch.setenv(dispatch.FP8_ATTENTION_ENV, env)
    q = jax.ShapeDtypeStruct((1, 32, 128), jnp.bfloat16)
    k_pages = jax.ShapeDtypeStruct((1, 16, 8, 128), kv_dtype)
    kernel, reason = dispatch.choose_kernel(q, k_pages)
    assert kernel == "gpu"
    assert reason == want if want is None else want in reason


def test_the_switch_rejects_an_unknown_path(on_hopper, monkeypatch):
    monkeypatch.setenv(dispatch.FP8_ATTENTION_ENV, "fast")
    q = jax.ShapeDtypeStruct((1, 32, 128), jnp.bfloat16)
    k_pages = jax.ShapeDtypeStruct((1, 16, 8, 128), E4M3)
    with pytest.raises(ValueError, match="'fast' must be one of native, convert"):
        dispatch.choose_kernel(q, k_pages)


def _gpu_cases() -> list[Case]:
    return CPU_CASES + [
        Case("llama_decode_ragged", (1,) * 24, _RAGGED, 32, 8, 128, num_pad_tokens=5,
             num_dead_slots=3, kv_dtype=E4M3),
        Case("llama_decode_split4", (1,) * 6, _RAGGED[:6], 32, 8, 128, num_splits=4,
             kv_dtype=E4M3),
        Case("llama_mixed", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 32, 8, 128,
             num_pad_tokens=11, kv_dtype=E4M3),
        Case("llama_mixed_split3_e5m2", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 32, 8,
             128, num_splits=3, kv_dtype=E5M2),
        Case("llama_window_softcap", (200, 1, 1), (1200, 700, 33), 32, 8, 128,
             sliding_window=128, soft_cap=50.0, kv_dtype=E4M3),
        Case("g1_d128_page32", (1, 40, 1), (1000, 40, 33), 8, 8, 128, page_size=32,
             kv_dtype=E4M3),
        Case("g5_d64_page64", (65, 1, 33), (130, 513, 100), 10, 2, 64, page_size=64,
             num_pad_tokens=4, kv_dtype=E4M3),
        # Unsplit: the kernel starts each row's softmax from its sink (split: the merge adds it).
        Case("gpt_oss_mixed_window_sinks", (300, 1, 1, 77, 1), (300, 2049, 17, 500, 64), 64, 8,
             64, sliding_window=128, num_splits=1, kv_dtype=E4M3, has_sinks=True),
        Case("gpt_oss_decode_split4_sinks", (1,) * 6, _RAGGED[:6], 64, 8, 64, num_splits=4,
             has_sinks=True, kv_dtype=E4M3),
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90+) NVIDIA GPU")
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c.name)
def test_native_matches_the_same_scales_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    call = native_call(case, interpret=False)
    out = _poisoned_run(lambda *a: call(*a, **sinks), args, args[0].shape, args[0].dtype)
    assert_native_matches(case, out, args, sinks, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90+) NVIDIA GPU")
@pytest.mark.parametrize(("when", "lean"), [("read", False), ("p", False), ("end", True),
                                            ("read", True)])  # fmt: skip
@pytest.mark.parametrize(
    ("name", "block_kv"),
    [("llama_decode_ragged", 128), ("llama_decode_ragged", 64), ("llama_decode_split4", 64),
     ("llama_mixed", 128), ("llama_mixed_split3_e5m2", 64), ("gpt_oss_mixed_window_sinks", 64)],
)  # fmt: skip
def test_native_copies_issued_earlier_match(name: str, block_kv: int, when: str, lean: bool):
    """A slot's next copies issued before the softmax ("read": V transposed before QK^T) or
    after P ("p"), and P.V in place (``lean_registers``), the served decode's 128 tokens a
    step and the default 64."""
    case = next(c for c in _gpu_cases() if c.name == name)
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    args, sinks = make_inputs(rng, case), make_sinks(rng, case)
    call = native_call(
        case, interpret=False, issue_next=when, block_kv=block_kv, lean_registers=lean
    )
    out = _poisoned_run(lambda *a: call(*a, **sinks), args, args[0].shape, args[0].dtype)
    assert_native_matches(case, out, args, sinks, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90+) NVIDIA GPU")
@pytest.mark.parametrize("config", [dict(block_kv=128), dict(num_stages=4)], ids=str)
def test_native_other_tiles_match(config: dict):
    case = next(c for c in _gpu_cases() if c.name == "llama_mixed")
    seed = int(np.random.default_rng().integers(2**31))
    args = make_inputs(np.random.default_rng(seed), case)
    out = jax.jit(native_call(case, interpret=False, **config))(*args)
    assert_native_matches(case, out, args, {}, seed)
