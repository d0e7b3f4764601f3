"""The fp8 KV cache (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``): quantization, the
reference attention over it, the checkpoint's scales, and the model through ``jaxserve.LLM``.

Tolerances (documented in docs/kv_cache_fp8.md):
- quantize then dequantize: within half an fp8 ulp, relative (2^-4 for e4m3, 2^-3 for e5m2) in
  the normal range; past the range, saturated to +-max * scale.
- reference attention over an fp8 cache (scales amax / fp8 max) against the bf16 cache, random
  normal q/k/v: relative error (Frobenius) below 5% for e4m3 and 10% for e5m2 (measured 3.4%
  and 6.9%).
- the fixture model (bf16 weights, 2 layers, logits of scale ~3) with an e4m3 cache against
  the same model with a bf16 cache: greedy agreement 100% on the steps whose top-2 margin is at
  least 0.1 (asserted >= 95%, and 100% at 0.25), logprob error 0.058 mean, 0.29 max.
"""

from __future__ import annotations

import argparse
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import jaxserve
from jaxserve import SamplingParams
from jaxserve.engine_config import EngineConfig, kv_cache_dtype_name
from jaxserve.models.kv_scales import KVScales, load_kv_scales
from jaxserve.models.loading.checkpoint_reader import WeightsError
from jaxserve.runner import devices
from jaxserve.server.launch.flags import engine_config_from_args
from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import dispatch, reference
from tests.conftest import fixture_dir

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}
ATTENTION_TOLERANCE = {E4M3: 0.05, E5M2: 0.10}
MARGIN = 0.1  # top-2 logit margin below which a step is a near tie and not compared


# -- quantization --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_dequantize_round_trip(dtype) -> None:
    scale = 0.37
    finfo = jnp.finfo(dtype)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4096) * 40.0, jnp.float32)
    got = kv_cache.dequantize_kv(kv_cache.quantize_kv(x, dtype, scale), scale)
    is_normal = (jnp.abs(x) >= float(finfo.smallest_normal) * scale) & (
        jnp.abs(x) <= float(finfo.max) * scale
    )
    rel = jnp.abs(got - x) / jnp.abs(x)
    assert float(jnp.max(jnp.where(is_normal, rel, 0.0))) <= HALF_ULP[dtype]
    assert float(jnp.mean(rel[is_normal])) < HALF_ULP[dtype] / 2  # rounds, not truncates
    # Values the cache can hold come back exactly; past the range they saturate (no inf/NaN).
    exact = jnp.asarray([0.0, 1.0, -1.5, 2.0**-6, 448.0 if dtype == E4M3 else 57344.0])
    np.testing.assert_array_equal(kv_cache.dequantize_kv(kv_cache.quantize_kv(exact, dtype)), exact)
    huge = jnp.asarray([1e9, -1e9, float(finfo.max) * scale * 1.01])
    stored = kv_cache.quantize_kv(huge, dtype, scale)
    np.testing.assert_array_equal(
        np.asarray(stored.astype(jnp.float32)), [finfo.max, -finfo.max, finfo.max]
    )
    # Other dtypes: a plain cast, no scale.
    assert kv_cache.quantize_kv(x, jnp.bfloat16).dtype == jnp.bfloat16


def test_write_kv_stores_quantized_values_and_drops_padding() -> None:
    rng = np.random.default_rng(1)
    pages = jnp.zeros((4, 2, 2, 8), E4M3)  # [P, page_size, Hkv, D]
    k = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.bfloat16)  # [T, Hkv, D]
    v = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.bfloat16)
    slots = jnp.asarray([5, 0, 8], jnp.int32)  # 8 = P * page_size: a padding row, dropped
    k_pages, v_pages = kv_cache.write_kv(pages, pages, k, v, slots, k_scale=0.5, v_scale=2.0)
    assert k_pages.dtype == v_pages.dtype == E4M3
    flat_k = k_pages.reshape(8, 2, 8).astype(jnp.float32)
    flat_v = v_pages.reshape(8, 2, 8).astype(jnp.float32)
    want_k = kv_cache.quantize_kv(k, E4M3, 0.5).astype(jnp.float32)
    want_v = kv_cache.quantize_kv(v, E4M3, 2.0).astype(jnp.float32)
    np.testing.assert_array_equal(flat_k[5], want_k[0])
    np.testing.assert_array_equal(flat_k[0], want_k[1])
    np.testing.assert_array_equal(flat_v[0], want_v[1])
    np.testing.assert_array_equal(np.delete(np.asarray(flat_k), [0, 5], axis=0), 0.0)


# -- attention -----------------------------------------------------------------------------


def attention_inputs(seed: int):
    """A ragged batch (decodes beside a prefill chunk) over a shuffled bf16 page table."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens, page = (1, 9, 1), (30, 20, 7), 8
    pages_per_seq = 4
    page_indices = rng.permutation(16)[:12].reshape(3, 4).astype(np.int32)
    kv_shape = (16, page, 2, 64)  # [P, page_size, Hkv, D]

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    assert max(kv_lens) <= pages_per_seq * page
    return (
        normal(sum(q_lens) + 2, 8, 64),  # q [T, Hq, D], GQA 4, two padding rows
        normal(*kv_shape),
        normal(*kv_shape),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(page_indices),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        jnp.asarray([3], jnp.int32),
    )


def amax_scale(x: jax.Array, dtype) -> float:
    """A calibrated per-tensor scale: the largest magnitude maps to the fp8 maximum."""
    return float(jnp.max(jnp.abs(x.astype(jnp.float32)))) / float(jnp.finfo(dtype).max)


@pytest.mark.parametrize("dtype", FP8)
def test_reference_attention_over_fp8_cache_stays_close_to_bf16(dtype) -> None:
    q, k, v, *meta = attention_inputs(seed=2)
    options = dict(sm_scale=64**-0.5)
    want = reference.ragged_paged_attention(q, k, v, *meta, **options)
    k_scale, v_scale = amax_scale(k, dtype), amax_scale(v, dtype)
    k8, v8 = kv_cache.quantize_kv(k, dtype, k_scale), kv_cache.quantize_kv(v, dtype, v_scale)
    got = reference.ragged_paged_attention(
        q, k8, v8, *meta, **options, k_scale=k_scale, v_scale=v_scale
    )
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rel = np.linalg.norm(got32 - want32) / np.linalg.norm(want32)
    assert rel < ATTENTION_TOLERANCE[dtype], rel
    assert rel > 1e-3  # the cache really is fp8
    np.testing.assert_array_equal(got32[11:], 0.0)  # padding rows
    # Without its scales the same cache reads as values k_scale times too small.
    unscaled = reference.ragged_paged_attention(q, k8, v8, *meta, **options)
    assert np.linalg.norm(np.asarray(unscaled, np.float32) - want32) > 10 * rel * np.linalg.norm(
        want32
    )


def test_scales_of_none_mean_one() -> None:
    q, k, v, *meta = attention_inputs(seed=3)
    k8, v8 = kv_cache.quantize_kv(k, E4M3), kv_cache.quantize_kv(v, E4M3)
    plain = reference.ragged_paged_attention(q, k8, v8, *meta, sm_scale=0.125)
    ones = reference.ragged_paged_attention(
        q, k8, v8, *meta, sm_scale=0.125, k_scale=1.0, v_scale=1.0
    )
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(ones, np.float32))


# -- checkpoint scales ---------------------------------------------------------------------


def checkpoint_with(tmp_path, tensors: dict[str, np.ndarray]):
    """The llama fixture plus a second safetensors file holding ``tensors``."""
    model_dir = tmp_path / "llama_fp8_scales"
    shutil.copytree(fixture_dir("llama"), model_dir)
    save_file(tensors, str(model_dir / "kv_scales.safetensors"))
    return model_dir


def test_scales_are_read_under_every_name_vllm_reads(tmp_path) -> None:
    model_dir = checkpoint_with(
        tmp_path,
        {
            "model.layers.0.self_attn.k_proj.output_scale": np.asarray([0.25], np.float32),
            "model.layers.0.self_attn.v_proj.output_scale": np.asarray(0.5, np.float32),
            "model.layers.1.self_attn.kv_scale": np.asarray(0.75, np.float32),
        },
    )
    scales = load_kv_scales(model_dir, num_layers=2)
    assert scales == KVScales(((0.25, 0.5), (0.75, 0.75)), num_from_checkpoint=2)
    assert "from the checkpoint for all 2 layers" in scales.describe()
    plain = load_kv_scales(fixture_dir("llama"), num_layers=2)
    assert plain == KVScales.ones(2) and "scale 1.0 for every layer" in plain.describe()
    partial = checkpoint_with(
        tmp_path / "b", {"model.layers.1.self_attn.k_scale": np.asarray(2.0, np.float32)}
    )
    assert load_kv_scales(partial, 2).scales == ((1.0, 1.0), (2.0, 1.0))
    assert "for 1 of 2 layers, 1.0 for the other 1" in load_kv_scales(partial, 2).describe()


@pytest.mark.parametrize(
    ("value", "message"),
    [(np.ones(2, np.float32), "only one scale per tensor"), (np.asarray(0.0), "must be > 0")],
)
def test_bad_scales_are_errors_that_name_the_tensor(tmp_path, value, message) -> None:
    model_dir = checkpoint_with(tmp_path, {"model.layers.0.self_attn.v_scale": value})
    with pytest.raises(WeightsError, match=message) as info:
        load_kv_scales(model_dir, 2)
    assert "model.layers.0.self_attn.v_scale" in str(info.value)


# -- configuration and devices -------------------------------------------------------------


def test_kv_cache_dtype_choices_and_names() -> None:
    assert kv_cache_dtype_name("auto", "bfloat16") == "bfloat16"
    assert kv_cache_dtype_name("fp8", "bfloat16") == "fp8_e4m3"  # as vLLM on CUDA
    assert kv_cache_dtype_name("fp8_e5m2", "float32") == "fp8_e5m2"
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3, fp8_e5m2") as info:
        EngineConfig(kv_cache_dtype="int8")
    assert "kv_cache_dtype='int8'" in str(info.value)


def test_launch_flag_reaches_the_engine_config(capsys) -> None:
    from jaxserve.cli import build_parser

    def parse(*flags: str) -> argparse.Namespace:
        argv = ["launch", *flags]
        return build_parser(argv).parse_args(argv)

    assert engine_config_from_args(parse()).kv_cache_dtype == "auto"
    assert engine_config_from_args(parse("--kv-cache-dtype", "fp8")).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit) as exit_info:
        parse("--kv-cache-dtype", "fp4")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'" in err


class FakeGpu:
    platform = "gpu"

    def __init__(self, kind: str, compute_capability: str) -> None:
        self.device_kind = kind
        self.compute_capability = compute_capability


@pytest.mark.parametrize(
    ("capability", "has_fp8"), [("8.0", False), ("8.6", False), ("8.9", True), ("9.0", True)]
)
def test_fp8_needs_compute_capability_8_9(capability, has_fp8) -> None:
    assert devices.has_fp8(FakeGpu("GPU", capability)) is has_fp8  # type: ignore[arg-type]


def test_fp8_on_a_gpu_without_it_is_a_startup_error(monkeypatch) -> None:
    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu("NVIDIA A100-SXM4-80GB", "8.0")])
    config = EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(devices.DeviceSupportError) as info:
        devices.resolve_kv_dtype(config, jnp.dtype(jnp.bfloat16))
    message = str(info.value)
    assert "NVIDIA A100-SXM4-80GB" in message and "compute capability 8.0" in message
    assert "--kv-cache-dtype fp8 (fp8_e4m3)" in message
    # auto never needs fp8
    auto = devices.resolve_kv_dtype(EngineConfig(), jnp.dtype(jnp.bfloat16))
    assert auto == jnp.bfloat16
    monkeypatch.setattr(jax, "devices", lambda *a: [FakeGpu("NVIDIA H200", "9.0")])
    assert devices.resolve_kv_dtype(config, jnp.dtype(jnp.bfloat16)) == E4M3


def test_launch_on_a_device_without_fp8_exits_naming_device_and_dtype(caplog, monkeypatch):
    from jaxserve.cli import build_parser
    from jaxserve.server.launch.serve import run_launch
    from tests.conftest import free_port

    monkeypatch.setattr(devices, "has_fp8", lambda device: False)  # as an A100 answers
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # launch sets it; restored
    argv = ["launch", str(fixture_dir("llama")), "--host", "127.0.0.1", "--port",
            str(free_port()), "--kv-cache-dtype", "fp8_e5m2", "--max-model-len", "64"]  # fmt: skip
    caplog.set_level(logging.INFO)
    assert run_launch(build_parser(argv).parse_args(argv), memory_query=lambda: "none") == 1
    (message,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert message.startswith("--kv-cache-dtype fp8_e5m2 (fp8_e5m2) needs fp8 support")
    assert f"{jax.devices()[0].device_kind} has compute capability" in message
    assert "Loaded weights" not in caplog.text  # it stops before loading


# -- the model through jaxserve.LLM --------------------------------------------------------


def make_llm(kv_cache_dtype: str, model_dir=None) -> jaxserve.LLM:
    return jaxserve.LLM(
        str(model_dir or fixture_dir("llama")),
        kv_cache_dtype=kv_cache_dtype,
        dtype="bfloat16",  # auto: a bf16 cache, the baseline fp8 is measured against
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=16,  # the 56-token prompt prefills in chunks over the cache
        block_size=4,
        num_gpu_blocks_override=64,
        warmup=False,
    )


def teacher_forced(llm: jaxserve.LLM, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logprob of each next token, top-2 margin) at every position after the first."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    chosen, margins, top1 = [], [], []
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        chosen.append(entry[ids[position]].logprob)
        margins.append(ranked[0].logprob - ranked[1].logprob)
        top1.append(max(entry, key=lambda t: entry[t].logprob))
    return np.asarray(chosen), np.asarray(margins), np.asarray(top1)


@pytest.fixture(scope="module")
def float_and_fp8():
    """The prompt + greedy continuation of the bf16-cache model, teacher-forced through bf16,
    e4m3 and e5m2 caches (bf16 weights throughout)."""
    golden = np.load(fixture_dir("llama") / "golden.npz")
    prompt = golden["prompt2_ids"].tolist()
    reference_llm = make_llm("auto")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = reference_llm.generate({"prompt_token_ids": prompt}, greedy)[0].outputs[0].token_ids
    ids = prompt + list(tokens)
    fp8_llm = make_llm("fp8")
    runs = {
        "auto": teacher_forced(reference_llm, ids),
        "fp8": teacher_forced(fp8_llm, ids),
        "fp8_e5m2": teacher_forced(make_llm("fp8_e5m2"), ids),
    }
    return ids, runs, fp8_llm


def test_llm_allocates_an_fp8_cache(float_and_fp8) -> None:
    *_, llm = float_and_fp8
    runner = llm.engine.runner
    assert runner.kv_dtype == E4M3 and runner.kv_scales == ((1.0, 1.0), (1.0, 1.0))
    k_pages, v_pages = runner.kv_cache[0]
    assert k_pages.dtype == v_pages.dtype == E4M3
    assert runner.abstract_kv_cache()[1][0].dtype == E4M3
    assert "(KV cache dtype fp8_e4m3)" in llm.engine.capacity_lines()[2]


# kv_cache_dtype -> (margin, least agreement with the bf16 cache on steps whose top-2 margin
# is >= margin, most mean and max |logprob error|). Measured (79 steps; 68 with a margin >= 0.1,
# 52 >= 0.25): e4m3 100% at both, errors 0.058 mean / 0.29 max; e5m2 91% at 0.1 and 94% at
# 0.25, errors 0.11 / 0.62.
AGREEMENT = {
    "fp8": [(0.1, 0.95, 0.08, 0.5), (0.25, 1.0, 0.08, 0.5)],
    "fp8_e5m2": [(0.1, 0.85, 0.2, 0.9)],
}


@pytest.mark.parametrize("kv_cache_dtype", AGREEMENT)
def test_fp8_cache_keeps_greedy_tokens_and_logprobs(float_and_fp8, kv_cache_dtype) -> None:
    """Teacher-forced over a prompt and its greedy continuation (prefill chunks and decode
    positions alike read the fp8 cache): the argmax agrees where the top-2 margin is not tiny."""
    _, runs, _ = float_and_fp8
    lp_ref, margin_ref, top_ref = runs["auto"]
    lp_fp8, _, top_fp8 = runs[kv_cache_dtype]
    error = np.abs(lp_fp8 - lp_ref)
    for margin, least_agreement, most_mean_error, most_error in AGREEMENT[kv_cache_dtype]:
        clear = margin_ref >= margin
        assert clear.sum() >= len(clear) // 2  # most steps are compared
        agreement = float(np.mean(top_fp8[clear] == top_ref[clear]))
        assert agreement >= least_agreement, (margin, agreement)
        assert float(error.mean()) < most_mean_error and float(error.max()) < most_error
    assert float(error.max()) > 1e-3  # the cache really is fp8


def test_checkpoint_scales_reach_the_model(tmp_path, float_and_fp8) -> None:
    """A checkpoint's k_scale / v_scale are loaded and used: scales far too small saturate
    the e4m3 cache (max 448) and wreck the logprobs; scales that fit keep them close."""
    ids, runs, _ = float_and_fp8
    lp_ref = runs["auto"][0]
    errors = {}
    for name, scale in (("tiny", 1e-3), ("fitting", 0.05)):
        tensors = {
            f"model.layers.{n}.self_attn.{which}_scale": np.asarray(scale, np.float32)
            for n in range(2)
            for which in ("k", "v")
        }
        llm = make_llm("fp8_e4m3", checkpoint_with(tmp_path / name, tensors))
        assert llm.engine.runner.kv_dtype == E4M3
        assert llm.engine.runner.kv_scales == ((float(np.float32(scale)),) * 2,) * 2
        errors[name] = float(np.mean(np.abs(teacher_forced(llm, ids)[0] - lp_ref)))
    assert errors["fitting"] < 0.08 < 1.0 < errors["tiny"], errors


def test_layers_with_different_scales_share_one_attention_program() -> None:
    """The scales enter the attention op as arguments: one traced (and lowered) kernel for
    every layer, as with a bf16 cache (a Mosaic GPU lowering takes about a second)."""
    import functools

    from jaxserve.models.batch import Batch, make_kv_cache
    from jaxserve.models.families.registry import load_model_config
    from jaxserve.models.loading.checkpoint_loader import load_weights
    from jaxserve.runner.packing import pack
    from jaxserve.runner.programs import model_step, shared_attention

    config = load_model_config(fixture_dir("llama"))
    weights = load_weights(fixture_dir("llama"), config, jnp.float32)
    cache = make_kv_cache(2, 8, 4, config.num_kv_heads, config.head_dim, E4M3)
    step = functools.partial(
        model_step,
        config=config,
        attention_fn=shared_attention(dispatch.ragged_paged_attention),
        kv_scales=((0.5, 0.25), (2.0, 4.0)),
    )
    batch = Batch.padding(16, 4, 4, 32)
    packed, layout = pack((batch, np.full(16, -1, np.int32)))
    previous_ids = jnp.zeros(4, jnp.int32)
    jaxpr = jax.make_jaxpr(step, static_argnums=(4,))(weights, cache, packed, previous_ids, layout)
    calls = [e for e in jaxpr.eqns if e.params.get("name") == "ragged_paged_attention"]
    assert len(calls) == 2 and calls[0].params["jaxpr"] is calls[1].params["jaxpr"]
    assert all(len(e.invars) == 9 for e in calls)  # q, pages, metadata, k_scale, v_scale


def test_cache_writes_promise_unique_slots_and_drop_the_shared_padding_slot():
    """Each token owns its slot; padding rows share one out-of-range slot and are dropped. The
    writes tell XLA the slots are unique (plain stores, not atomic read-modify-writes)."""
    import jax.numpy as jnp

    from pallas_kernels.kv_cache import write_kv, write_latent

    pages = jnp.zeros((4, 4, 2, 8), jnp.bfloat16)
    new = jnp.arange(5 * 2 * 8, dtype=jnp.float32).reshape(5, 2, 8).astype(jnp.bfloat16)
    slots = jnp.array([0, 5, 9, 16, 16], jnp.int32)  # two padding rows at 16 = 4 pages x 4
    k, v = write_kv(pages, pages, new, new, slots)
    flat = np.asarray(k.astype(jnp.float32)).reshape(16, 2, 8)
    np.testing.assert_array_equal(flat[[0, 5, 9]], np.asarray(new[:3].astype(jnp.float32)))
    assert np.count_nonzero(flat.reshape(16, -1).any(axis=1)) == 3  # the padding: nowhere
    text = jax.jit(write_kv).lower(pages, pages, new, new, slots).as_text()
    assert text.count("unique_indices = true") == text.count('"stablehlo.scatter"(') > 0
    latent = jnp.zeros((4, 4, 1, 8), jnp.bfloat16)
    rows = new[:, 0]
    text = jax.jit(write_latent).lower(latent, latent, rows, rows, slots).as_text()
    assert text.count("unique_indices = true") == text.count('"stablehlo.scatter"(') > 0
