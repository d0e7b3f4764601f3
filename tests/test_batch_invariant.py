"""Batch-invariant mode (``--batch-invariant``): a sequence's logits are bitwise the same alone,
among 63 other sequences of other prompt lengths, with its prompt chunked over several steps,
and in decode steps of other batch sizes (docs/determinism.md).

The model-level tests run ``decoder.forward`` and ``compute_logits`` on ragged steps built here,
padded to the runner's buckets, and compare every logit of the target's rows bit for bit; the
engine-level test runs ``LLM(batch_invariant=True)`` and compares prompt and sampled logprobs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models import decoder
from jaxserve.models.batch import Batch, make_kv_cache_for
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.dummy import dummy_weights
from jaxserve.models.quant import INVARIANT_ROW_TILE, tiled_rows
from jaxserve.runner.buckets import next_power_of_2
from jaxserve.runner.devices import describe_batch_invariance
from jaxserve.runner.programs import invariant_compiler_options
from pallas_kernels.ragged_paged_attention import dispatch
from tests.conftest import fixture_dir

PAGE = 16
PAGES_PER_SEQ = 8  # 128 tokens of context per sequence
NUM_SEQS = 64
RNG = np.random.default_rng(38)
TARGET = [0, *RNG.integers(5, 320, 44).tolist()]  # 45 prompt tokens
OTHERS = [[0, *RNG.integers(5, 320, n).tolist()] for n in RNG.integers(2, 40, NUM_SEQS - 1)]
DECODE_IDS = [7, 11, 13]  # the tokens fed to three decode steps


@dataclasses.dataclass
class Seq:
    tokens: list[int]  # every token it will hold
    slot: int  # its pages: [slot * PAGES_PER_SEQ, (slot + 1) * PAGES_PER_SEQ)
    num_computed: int = 0

    @property
    def prompt_left(self) -> int:
        return len(self.tokens) - len(DECODE_IDS) - self.num_computed


def build_step(work: list[tuple[Seq, int]]) -> Batch:
    """One step computing ``n`` more tokens of each (seq, n), padded as the runner pads: the
    tokens to a power of two from 16, the sequence rows to min(that, 64)."""
    num_tokens = sum(n for _, n in work)
    token_bucket = max(16, next_power_of_2(num_tokens))
    seq_bucket = min(token_bucket, NUM_SEQS)
    num_slots = NUM_SEQS * PAGES_PER_SEQ * PAGE
    ids, pos, slots = [], [], []
    kv_lens = np.zeros(seq_bucket, np.int32)
    pages = np.zeros((seq_bucket, PAGES_PER_SEQ), np.int32)
    cu = np.zeros(seq_bucket + 1, np.int32)
    for i, (seq, n) in enumerate(work):
        start = seq.num_computed
        first_page = seq.slot * PAGES_PER_SEQ
        for p in range(start, start + n):
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append((first_page + p // PAGE) * PAGE + p % PAGE)
        kv_lens[i] = start + n
        pages[i] = np.arange(first_page, first_page + PAGES_PER_SEQ)
        cu[i + 1] = cu[i] + n
    cu[len(work) + 1 :] = cu[len(work)]
    padding = token_bucket - num_tokens
    return Batch(
        input_ids=jnp.asarray(ids + [0] * padding, jnp.int32),
        positions=jnp.asarray(pos + [0] * padding, jnp.int32),
        slot_mapping=jnp.asarray(slots + [num_slots] * padding, jnp.int32),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(pages),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(work)], jnp.int32),
        logits_indices=jnp.asarray(np.maximum(cu[1:] - 1, 0)),
    )


# Llama-3's attention geometry (head_dim 128, 4 query heads per KV head: the Mosaic GPU
# kernel's shapes) in two small layers, for the GPU test.
GPU_CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=2048,
    hidden_size=1024,
    intermediate_size=2048,
    num_layers=2,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=128,
    max_position_embeddings=1024,
)


@functools.cache
def model(
    dtype_name: str,
    invariant: bool,
    on_gpu: bool = False,
    compiler_options: tuple[tuple[str, object], ...] | None = None,  # hashable: cached
):
    """(step, config, dtype): ``step(cache, batch) -> (cache, f32[T, V] logits of every
    row)``, in batch-invariant mode or not; the llama fixture, or ``GPU_CONFIG`` with random
    weights; ``compiler_options``: XLA's, for the step, as (name, value) pairs (None: the
    runner's for the mode)."""
    dtype = jnp.dtype(dtype_name)
    if on_gpu:
        config = GPU_CONFIG
        weights = dummy_weights(config, dtype, scale=0.05)
    else:
        config = load_model_config(fixture_dir("llama"))
        weights = load_weights(fixture_dir("llama"), config, dtype)
    row_tile = INVARIANT_ROW_TILE if invariant else None
    attention = functools.partial(dispatch.ragged_paged_attention, batch_invariant=invariant)

    options = (
        invariant_compiler_options(invariant)
        if compiler_options is None
        else dict(compiler_options)
    )

    @functools.partial(jax.jit, compiler_options=options)
    def step(weights, cache, batch):
        cache, hidden = decoder.forward(weights, cache, batch, config, attention, row_tile=row_tile)
        return cache, decoder.compute_logits(weights, hidden, None, row_tile)

    return functools.partial(step, weights), config, dtype


def target_logits(
    dtype_name: str,
    invariant: bool,
    others: list[list[int]],
    chunk: int | None,
    on_gpu: bool = False,
    compiler_options: dict | None = None,
) -> np.ndarray:
    """f32[45 + 3, V]: the target's logits at every prompt position, then at three decode
    steps in which every other sequence decodes too; the target sits in row 17 of a batch
    (``others`` around it), its prompts computed ``chunk`` tokens a step (None: at once)."""
    options = None if compiler_options is None else tuple(sorted(compiler_options.items()))
    step, config, dtype = model(dtype_name, invariant, on_gpu, options)
    cache = make_kv_cache_for(config, NUM_SEQS * PAGES_PER_SEQ, PAGE, dtype)
    target = Seq(TARGET + DECODE_IDS, slot=17)
    seqs = [Seq(p + DECODE_IDS, slot=i if i < 17 else i + 1) for i, p in enumerate(others)]
    seqs.insert(min(17, len(seqs)), target)
    rows = []
    while target.num_computed < len(TARGET):  # prefill, chunk by chunk
        work = [(seq, min(seq.prompt_left, chunk or seq.prompt_left)) for seq in seqs]
        work = [(seq, n) for seq, n in work if n > 0]
        cache, logits = step(cache, build_step(work))
        offset = 0
        for seq, n in work:
            if seq is target:
                rows.append(np.asarray(logits[offset : offset + n]))
            offset += n
            seq.num_computed += n
    for seq in seqs:  # the others finish their prompts before the decode steps
        if seq.prompt_left:
            cache, _ = step(cache, build_step([(seq, seq.prompt_left)]))
            seq.num_computed += seq.prompt_left
    for _ in DECODE_IDS:  # every sequence decodes one token a step
        row = seqs.index(target)
        cache, logits = step(cache, build_step([(seq, 1) for seq in seqs]))
        rows.append(np.asarray(logits[row : row + 1]))
        for seq in seqs:
            seq.num_computed += 1
    return np.concatenate(rows)


SCENARIOS = {  # (others, chunk): the target among 63 others, its prompt chunked, or both
    "in a batch of 63": (OTHERS, None),
    "chunked by 8": ([], 8),
    "in a batch of 63, chunked by 8": (OTHERS, 8),
}


def differing_rows(a: np.ndarray, b: np.ndarray) -> list[int]:
    """The rows of two logits arrays whose bits differ anywhere."""
    return np.flatnonzero((a.view(np.uint32) != b.view(np.uint32)).any(axis=1)).tolist()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_logits_are_bitwise_the_same_alone_batched_and_chunked(dtype_name: str) -> None:
    """Every logit of the target's 45 prompt positions and of three decode steps (alone: a
    batch of one in the smallest bucket; else among 64 decoding sequences)."""
    alone = target_logits(dtype_name, True, [], None)
    assert alone.shape == (len(TARGET) + len(DECODE_IDS), 320) and np.isfinite(alone).all()
    for name, (others, chunk) in SCENARIOS.items():
        got = target_logits(dtype_name, True, others, chunk)
        assert differing_rows(alone, got) == [], name


def test_without_the_mode_float32_logits_depend_on_the_batch_on_this_cpu() -> None:
    """The mode matters: without it the same float32 steps give other bits on the CPU (in
    jax 0.11.2 the GEMMs' row results followed the row count, and the RMSNorm's mean, fused
    into steps of other shapes, moved by an ulp). bfloat16 happened to be invariant on the
    CPU without the mode, so only float32 is pinned here."""
    if jax.default_backend() != "cpu":
        pytest.skip("an observation of XLA's CPU backend")
    alone = target_logits("float32", False, [], None)
    others, chunk = SCENARIOS["chunked by 8"]
    assert differing_rows(alone, target_logits("float32", False, others, chunk)) != []


@pytest.mark.gpu
def test_logits_are_bitwise_the_same_on_the_gpu_kernels() -> None:
    """On a GPU: bfloat16 through the Pallas attention kernel that ``dispatch`` picks (Mosaic
    GPU on Hopper, at head_dim 128) and XLA's GEMMs on 128-row tiles; without the mode the
    KV split (which follows the step's size) and the GEMMs' algorithms change the bits."""
    alone = target_logits("bfloat16", True, [], None, on_gpu=True)
    for name, (others, chunk) in SCENARIOS.items():
        got = target_logits("bfloat16", True, others, chunk, on_gpu=True)
        assert differing_rows(alone, got) == [], name


def logprob_bits(out) -> list[tuple[int, int, int]]:
    """(position, token, f32 bits of its logprob) of every prompt and sampled logprob."""
    rows = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
    return [
        (i, token, int(np.float32(lp.logprob).view(np.uint32)))
        for i, row in enumerate(rows)
        for token, lp in sorted(row.items())
    ]


def test_llm_logprobs_are_bitwise_the_same_alone_and_among_63_others() -> None:
    """Through ``LLM(batch_invariant=True)``: 20 prompt and sampled logprobs a position,
    with a step budget of 64 tokens, so the target's prompt runs in one step alone and in
    chunks beside 63 others' prompts and decodes."""
    llm = jaxserve.LLM(
        str(fixture_dir("llama")),
        batch_invariant=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=NUM_SEQS,
        max_num_batched_tokens=64,
        block_size=PAGE,
        num_gpu_blocks_override=NUM_SEQS * PAGES_PER_SEQ,
        warmup=False,
    )
    params = SamplingParams(
        temperature=0.8, seed=5, max_tokens=4, logprobs=20, prompt_logprobs=20, ignore_eos=True
    )
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    target = {"prompt_token_ids": TARGET}
    alone = llm.generate(target, params, use_tqdm=False)[0]
    prompts = [{"prompt_token_ids": p} for p in OTHERS]
    batch = llm.generate(
        prompts[:17] + [target] + prompts[17:], [plain] * 17 + [params] + [plain] * 46
    )[17]
    assert batch.outputs[0].token_ids == alone.outputs[0].token_ids
    assert logprob_bits(batch) == logprob_bits(alone)


def test_the_mode_refuses_what_it_does_not_cover_and_says_it_is_on() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)
    moe_config = load_model_config(fixture_dir("mixtral"))
    with pytest.raises(ValueError, match="mixture of experts"):
        decoder.check_row_tile(moe_config, INVARIANT_ROW_TILE)
    decoder.check_row_tile(moe_config, None)  # the mode off: any model
    assert describe_batch_invariance().startswith("Batch-invariant mode: on")


def test_the_flag_sets_the_engine_config() -> None:
    from jaxserve.cli import build_parser
    from jaxserve.server.launch.flags import engine_config_from_args

    for argv, want in ((["launch"], False), (["launch", "--batch-invariant"], True)):
        assert engine_config_from_args(build_parser(argv).parse_args(argv)).batch_invariant is want


def test_a_row_without_top_k_or_top_p_keeps_every_token_in_a_sorting_batch() -> None:
    """Its sampler variant is chosen by its batchmates; a row with neither option keeps its
    logits bit for bit there (a cumulative sum that rounds to 1 dropped its tail before)."""
    from jaxserve.runner.sampling import NEG_INF, apply_top_k_top_p

    row = jnp.zeros(1000, jnp.float32).at[0].set(30.0)  # the tail's mass rounds away
    logits = jnp.stack([row, row])
    out = np.asarray(apply_top_k_top_p(logits, jnp.array([0, 0]), jnp.array([1.0, 0.5])))
    assert np.array_equal(out[0], np.asarray(row))
    assert out[1, 0] == 30.0 and (out[1, 1:] == NEG_INF).all()


def test_the_modes_compiler_options_reach_every_program_it_warms_up(monkeypatch) -> None:
    """The mode's XLA options (cuBLAS, no timing: on a GPU only) ride on the programs' jits;
    JAX refuses them on a jit called inside another trace, so warm-up must only ever call
    those programs at the top level. Here CPU options stand in for the GPU's (the H200 once
    failed in warm-up: "compiler_options can only be passed to top-level jax.jit")."""
    from jaxserve.runner import programs

    seen = []

    def cpu_options(batch_invariant: bool) -> dict:
        seen.append(batch_invariant)
        return {"xla_cpu_enable_fast_math": False} if batch_invariant else {}

    monkeypatch.setattr(programs, "invariant_compiler_options", cpu_options)
    llm = jaxserve.LLM(
        str(fixture_dir("llama")),
        batch_invariant=True,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        block_size=PAGE,
        num_gpu_blocks_override=32,
    )
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": TARGET[:10]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and True in seen


def _tiled_layers_temporaries(num_layers: int) -> int:
    """XLA's planned temporaries of ``num_layers`` MLP layers whose GEMMs run in row tiles."""
    tokens, hidden, inner = 512, 256, 1024

    def mlp_layers(weights: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
        for w_up, w_down in weights:
            h = tiled_rows(lambda tile, w=w_up: tile @ w, x, INVARIANT_ROW_TILE)
            x = tiled_rows(lambda tile, w=w_down: tile @ w, jax.nn.silu(h), INVARIANT_ROW_TILE)
        return x

    weights = [
        (jnp.zeros((hidden, inner), jnp.bfloat16), jnp.zeros((inner, hidden), jnp.bfloat16))
        for _ in range(num_layers)
    ]
    x = jnp.zeros((tokens, hidden), jnp.bfloat16)
    compiled = jax.jit(mlp_layers).lower(weights, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_row_tiled_gemms_keep_a_steps_temporaries_flat_in_its_depth() -> None:
    # Each tiled GEMM's loop starts from its own input, not a zero constant that XLA merges
    # into one buffer live across every layer (0.16 GiB more a layer at the Llama-3-8B shape).
    # (a layer's [512, 1024] bf16 activations are 1 MiB; a few scalars a loop may remain)
    assert _tiled_layers_temporaries(6) - _tiled_layers_temporaries(1) < 64 * 1024


def test_row_tiled_rows_equal_the_untiled_product() -> None:
    x = jax.random.normal(jax.random.key(0), (300, 64), jnp.float32)  # two full tiles and 44
    w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
    tiled = tiled_rows(lambda tile: tile @ w, x, INVARIANT_ROW_TILE)
    assert tiled.shape == (300, 32)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
