"""On-device sampling over a batch, with per-request parameters as arrays.

Order of operations, per row: raw logprobs (log-softmax of the model's logits, what the API
returns) -> penalties -> logit bias (also the min_tokens EOS mask) -> temperature -> top-k ->
top-p -> min-p -> Gumbel-max with the request's own key ``fold_in(key(seed), position)``.
The noise is drawn over vocabulary ids for each row independently, so a seeded request samples
the same tokens whatever else is in the batch. Greedy rows (temperature 0) take the argmax.

Static flags select the variant (no sort unless some row uses top-k/top-p, no penalties or
bias unless some row uses them, no logprobs unless requested). A step with a constrained
sequence (structured outputs) takes a ``use_mask`` variant: a packed token bitmask per row,
applied after the logit bias, where a row without a constraint allows every token; those
variants sort or not as the host says (``use_sort``) and always draw the noise (a greedy row
takes its argmax all the same), so they add eight programs per bucket. No variant branches on
the device: XLA runs a GPU ``conditional`` by copying its predicate to the host and waiting
for the device to get there, so a sampler with one stalled the host until the step before
it had run. Every input has a fixed shape
per sequence bucket and variant (bias and token-history widths are set by the model's limits,
not by the request), so the set of programs is fixed: ``SamplerFlags.variants()`` lists it and
warm-up compiles all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxserve.units import cdiv

NEG_INF = float("-inf")
# Top logprobs computed for any request that asks: the API's cap, so one sampler variant serves
# every logprobs request.
NUM_TOP_LOGPROBS = MAX_LOGPROBS
PROMPT_LOGPROBS_CHUNK = 128  # prompt positions whose logits are computed at once

# The per-sequence sampling scalars, declared once: SamplingInputs field -> (host dtype, neutral
# value). The runner keeps a host table per entry (a row per running sequence), writes a row
# from ``row_values`` when a sequence is first scheduled and gathers each step's rows; padding
# rows hold the neutral value, which changes no logit.
ROW_FIELDS: dict[str, tuple[type[np.generic], float]] = {
    "temperature": (np.float32, 0.0),
    "top_k": (np.int32, 0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "seeds": (np.uint32, 0),
    "presence_penalty": (np.float32, 0.0),
    "frequency_penalty": (np.float32, 0.0),
    "repetition_penalty": (np.float32, 1.0),
}


def row_values(params: SamplingParams, seed: int) -> dict[str, float]:
    """One sequence's ROW_FIELDS values: the one place SamplingParams become sampler rows."""
    return {
        "temperature": params.temperature,
        "top_k": max(params.top_k, 0),
        "top_p": params.top_p,
        "min_p": params.min_p,
        "seeds": seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
    }


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    temperature: jax.Array  # f32[S]  0 = greedy
    top_k: jax.Array  # i32[S]  0 = disabled
    top_p: jax.Array  # f32[S]
    min_p: jax.Array  # f32[S]
    seeds: jax.Array  # u32[S]
    positions: jax.Array  # i32[S]  absolute position of the token being sampled
    bias_ids: jax.Array  # i32[S, B]  logit-bias token ids; V (out of range) = unused
    bias_values: jax.Array  # f32[S, B]
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]
    repetition_penalty: jax.Array  # f32[S]
    # Penalty inputs, [S, 0] unless the variant adjusts logits: prompt then generated tokens
    # (L = max_model_len; V = padding), and where the generated ones start.
    history_ids: jax.Array  # i32[S, L]
    num_prompt_tokens: jax.Array  # i32[S]
    # Allowed tokens, bit v % 32 of word v // 32 (W = ceil(V / 32)); [S, 0] unless use_mask.
    token_mask: jax.Array  # i32[S, W]

    @classmethod
    def padding(
        cls,
        num_rows: int,
        vocab_size: int,
        bias_width: int = 0,
        history_len: int = 0,
        use_mask: bool = False,
    ) -> SamplingInputs:
        """Host inputs of ``num_rows`` padding rows (neutral values): warm-up and the
        placeholders a multi-host follower fills by broadcast."""
        # numpy stands in for device arrays until device_put
        host: dict[str, Any] = {
            name: np.full(num_rows, value, dtype) for name, (dtype, value) in ROW_FIELDS.items()
        }
        host["positions"] = np.zeros(num_rows, np.int32)
        host["bias_ids"] = np.full((num_rows, bias_width), vocab_size, np.int32)
        host["bias_values"] = np.zeros((num_rows, bias_width), np.float32)
        host["history_ids"] = np.full((num_rows, history_len), vocab_size, np.int32)
        host["num_prompt_tokens"] = np.zeros(num_rows, np.int32)
        width = mask_width(vocab_size) if use_mask else 0
        host["token_mask"] = np.full((num_rows, width), -1, np.int32)  # -1: every token
        return cls(**host)


# SamplingInputs' leaf that holds the token mask, in the order ``packing.pack`` lays them out.
TOKEN_MASK_LEAF = [field.name for field in dataclasses.fields(SamplingInputs)].index("token_mask")


def mask_width(vocab_size: int) -> int:
    """32-bit words of one row's packed token bitmask."""
    return cdiv(vocab_size, 32)


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    use_sort: bool = False  # some row uses top-k or top-p
    # Some row has penalties, a logit bias, or stop tokens held back by min_tokens.
    adjust_logits: bool = False
    num_logprobs: int = -1  # -1: none; else the top-k logprobs to return (0 = chosen only)
    all_greedy: bool = False  # every row has temperature 0: no noise, no truncation
    # Some row is constrained: token_mask is applied (all_greedy stays False: the noise is
    # drawn and greedy rows take their argmax).
    use_mask: bool = False

    @staticmethod
    def compact_variants() -> tuple[SamplerFlags, ...]:
        """The three variants of ``compacted`` (what warm-up compiles when the sampler
        variants are compact): greedy, plain sampling, and the one that does everything."""
        return COMPACT_VARIANTS

    def compacted(self) -> SamplerFlags:
        """This step's variant among ``compact_variants``: itself if it is one, else the
        variant that does everything. Its tokens are this variant's, as a batchmate's top-p or
        penalties would make them (docs/determinism.md: a row's result does not depend on the
        variant its batch needs); its extra work (a sort over the vocabulary, a bias scatter,
        the top logprobs) is the cost of compiling 3 programs per bucket instead of 20."""
        return self if self in COMPACT_VARIANTS else EVERYTHING

    @staticmethod
    def variants() -> tuple[SamplerFlags, ...]:
        """Every variant a step can ask for (20): what warm-up compiles."""
        out = []
        for adjust in (False, True):
            for num_logprobs in (-1, NUM_TOP_LOGPROBS):
                out.append(SamplerFlags(False, adjust, num_logprobs, all_greedy=True))
                for use_sort in (False, True):
                    out.append(SamplerFlags(use_sort, adjust, num_logprobs, all_greedy=False))
                for use_sort in (False, True):
                    out.append(SamplerFlags(use_sort, adjust, num_logprobs, use_mask=True))
        return tuple(out)


# Top-k / top-p, penalties and bias, top logprobs, and a token mask (all allowed when unused).
EVERYTHING = SamplerFlags(True, True, NUM_TOP_LOGPROBS, all_greedy=False, use_mask=True)
COMPACT_VARIANTS = (SamplerFlags(all_greedy=True), SamplerFlags(), EVERYTHING)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array | None  # f32[S]  raw logprob of the chosen token
    ranks: jax.Array | None  # i32[S]  1-based rank of the chosen token
    top_ids: jax.Array | None  # i32[S, K]
    top_logprobs: jax.Array | None  # f32[S, K]


def _token_counts(ids: jax.Array, vocab_size: int) -> jax.Array:  # i32[S, L] -> i32[S, V]
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    counts = jnp.zeros((ids.shape[0], vocab_size), jnp.int32)
    return counts.at[rows, ids].add(1, mode="drop")


def apply_penalties(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """vLLM / OpenAI semantics: presence and frequency count generated tokens; repetition
    divides positive (multiplies negative) logits of any token seen in prompt or output."""
    vocab_size = logits.shape[-1]
    ids = inputs.history_ids  # i32[S, L]
    is_output = jnp.arange(ids.shape[1])[None, :] >= inputs.num_prompt_tokens[:, None]
    out_counts = _token_counts(jnp.where(is_output, ids, vocab_size), vocab_size)  # i32[S, V]
    seen = _token_counts(ids, vocab_size) > 0
    rep = inputs.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - inputs.frequency_penalty[:, None] * out_counts
    return logits - inputs.presence_penalty[:, None] * (out_counts > 0)


def apply_bias(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], inputs.bias_ids.shape)
    return logits.at[rows, inputs.bias_ids].add(inputs.bias_values, mode="drop")


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask tokens outside the top-k and outside the smallest set with probability >= top_p
    (never fewer than the top token: a tiny top_p keeps only it).

    Thresholds are taken on sorted values and applied to the unsorted row, so ties at the
    boundary are kept and no scatter is needed.
    """
    vocab_size = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # f32[S, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # f32[S, 1]
    logits = jnp.where(logits < kth, NEG_INF, logits)
    sorted_desc = jnp.where(jnp.arange(vocab_size)[None, :] < k[:, None], sorted_desc, NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly better tokens
    keep = mass_before < top_p[:, None]
    # NOTE: the top token is always kept. A top_p below float32's smallest value (1e-300) is 0
    # here: nothing would be kept, and index -1 would wrap to the last token, keeping them all.
    last_kept = jnp.maximum(jnp.sum(keep, axis=-1) - 1, 0)  # i32[S]
    cutoff = jnp.take_along_axis(sorted_desc, last_kept[:, None], axis=-1)
    # NOTE: a row with neither top-k nor top-p (in a batch where another row has one) keeps
    # every token: float32 rounding of the cumulative sum could otherwise drop its tail, so
    # its draw would depend on its batchmates' parameters.
    is_unmasked = ((top_k <= 0) & (top_p >= 1.0))[:, None]  # bool[S, 1]
    return jnp.where(~is_unmasked & (logits < cutoff), NEG_INF, logits)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < threshold, NEG_INF, logits)


def apply_token_mask(logits: jax.Array, token_mask: jax.Array) -> jax.Array:
    """Tokens whose bit is clear in the row's packed mask (i32[S, W]) get -inf."""
    vocab_size = logits.shape[-1]
    ids = jnp.arange(vocab_size)
    words = token_mask[:, ids // 32]  # i32[S, V]
    allowed = jnp.bitwise_and(jnp.right_shift(words, (ids % 32)[None, :]), 1) != 0
    return jnp.where(allowed, logits, NEG_INF)


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    def row(seed: jax.Array, position: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(row)(seeds, positions)  # f32[S, V]


def sample(logits: jax.Array, inputs: SamplingInputs, flags: SamplerFlags) -> SamplerOutput:
    """logits: f32[S, V] -> one token per row, plus logprobs when asked."""
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1) if flags.num_logprobs >= 0 else None
    if flags.adjust_logits:  # neutral for rows without penalties or bias
        logits = apply_bias(apply_penalties(logits, inputs), inputs)
    if flags.use_mask:
        logits = apply_token_mask(logits, inputs.token_mask)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if flags.all_greedy:
        return _with_logprobs(greedy_ids, raw_logprobs, flags)
    is_greedy = inputs.temperature <= 0.0
    token_ids = _sample_rows(logits, greedy_ids, is_greedy, inputs, flags.use_sort)
    return _with_logprobs(token_ids, raw_logprobs, flags)


def _sample_rows(
    logits: jax.Array,  # f32[S, V]
    greedy_ids: jax.Array,  # i32[S]
    is_greedy: jax.Array,  # bool[S]
    inputs: SamplingInputs,
    use_sort: bool,
) -> jax.Array:  # i32[S]
    temperature = jnp.where(is_greedy, 1.0, inputs.temperature)
    scaled = logits / temperature[:, None]
    if use_sort:
        scaled = apply_top_k_top_p(scaled, inputs.top_k, inputs.top_p)
    scaled = apply_min_p(scaled, inputs.min_p)
    noise = gumbel_noise(inputs.seeds, inputs.positions, logits.shape[-1])
    sampled_ids = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
    return jnp.where(is_greedy, greedy_ids, sampled_ids)


def _with_logprobs(
    token_ids: jax.Array, raw_logprobs: jax.Array | None, flags: SamplerFlags
) -> SamplerOutput:
    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None, None)
    chosen = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(raw_logprobs > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, max(flags.num_logprobs, 1))
    return SamplerOutput(token_ids, chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)


def prompt_logprobs(
    logits: jax.Array,  # f32[T, V]  logits at every token of the chunk
    next_ids: jax.Array,  # i32[T]  the token that follows each position
    num_top: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprob and rank of each next prompt token, and the top-``num_top`` alternatives."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, next_ids[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(lp > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(lp, max(num_top, 1))
    return chosen, ranks, top_ids.astype(jnp.int32), top_lp
