"""A policy-gradient (REINFORCE) loop in JAX with jaxserve as its sampler, in one process.

The policy is a flax.nnx Llama written below in the layout docs/training.md documents
(``embedder.embedding``, ``layers[i].self_attn.q_proj.kernel`` [in, out], ...), a dense causal
attention in float32, initialised from the demo model's safetensors (``jaxserve/assets/demo``,
the model ``jaxserve.LLM()`` serves with no model named). Each iteration:

1. the engine samples rollouts with the current weights (``LLM.generate``, with the sampled
   tokens' logprobs);
2. each rollout gets a reward: the fraction of its tokens that are ``TARGET`` (a word the
   demo model writes now and then), so a policy that writes it more often scores higher;
3. the trainer computes the REINFORCE loss in its own forward pass (advantage = reward minus
   the batch's mean), and optax's Adam updates the weights;
4. ``LLM.update_weights(nnx.state(policy))`` hands them back: the engine samples the next
   rollouts with them.

It prints the mean reward and the agreement between the engine's logprobs of the sampled
tokens and the trainer's for the same tokens and weights (the largest absolute difference).
Both run in float32; the engine's paged attention adds in another order than the trainer's
dense one, so they agree to about 1e-5, not bitwise.

    python examples/rl_loop.py --iterations 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import load_file

import jaxserve
from jaxserve.models.loading.named_weights import nnx_from_hf

DEMO = Path(jaxserve.__file__).parent / "assets" / "demo"
PROMPTS = ("def ", "class ", "The ", "import ")
TARGET = "("  # the token the reward counts (2.7% of the demo model's sampled tokens)
SAMPLES_PER_PROMPT = 4
MAX_TOKENS = 12


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def of(cls, model_dir: Path) -> LlamaConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=raw["num_attention_heads"],
            num_kv_heads=raw["num_key_value_heads"],
            head_dim=raw["head_dim"],
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=raw["rope_parameters"]["rope_theta"],
            tie_word_embeddings=raw["tie_word_embeddings"],
        )


# -- the policy: a Llama in flax.nnx, named as docs/training.md's table --------------------------


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float) -> None:
        self.scale = nnx.Param(jnp.ones(size, jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.scale[...] * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps)


def linear(n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)  # kernel [in, out]


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding, Hugging Face's rotate-half layout: x [B, T, heads, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.c = c
        self.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, rngs)
        self.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, rngs)
        self.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, rngs)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        c, (b, t, _) = self.c, x.shape
        q = rotate(self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim), cos, sin)
        k = rotate(self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        q = q.reshape(b, t, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(c.head_dim)
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
        return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim))


class MLP(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.gate_proj = linear(c.hidden_size, c.intermediate_size, rngs)
        self.up_proj = linear(c.hidden_size, c.intermediate_size, rngs)
        self.down_proj = linear(c.intermediate_size, c.hidden_size, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.self_attn = Attention(c, rngs)
        self.mlp = MLP(c, rngs)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.c = c
        self.embedder = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, rngs) for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else linear(c.hidden_size, c.vocab_size, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits f32[B, T, V] of tokens i32[B, T] (every sequence starts at position 0)."""
        c = self.c
        positions = jnp.arange(tokens.shape[1], dtype=jnp.float32)
        inv_freq = 1.0 / c.rope_theta ** (jnp.arange(0, c.head_dim, 2) / c.head_dim)
        angles = jnp.concatenate([positions[:, None] * inv_freq] * 2, axis=-1)  # [T, D]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.final_norm(x)
        if self.lm_head is None:
            return x @ self.embedder.embedding[...].T
        return self.lm_head(x)


def load_policy(model_dir: Path) -> Llama:
    """The policy with the checkpoint's weights (as float32), through the nnx mapping."""
    policy = Llama(LlamaConfig.of(model_dir), nnx.Rngs(0))
    tensors = {
        k: v.astype(np.float32) for k, v in load_file(model_dir / "model.safetensors").items()
    }
    state = nnx.state(policy, nnx.Param)
    nnx.replace_by_pure_dict(state, nnx_from_hf(tensors))
    nnx.update(policy, state)
    return policy


# -- the loss: REINFORCE with the batch's mean reward as the baseline ----------------------------


def token_logprobs(policy: Llama, tokens: jax.Array) -> jax.Array:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]): f32[B, T - 1]."""
    logprobs = jax.nn.log_softmax(policy(tokens)[:, :-1], axis=-1)
    return jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]


def reinforce_loss(policy: Llama, tokens, mask, advantages):
    """-E[advantage * log p(completion)], per completion token; and the token logprobs."""
    logprobs = token_logprobs(policy, tokens)
    loss = -jnp.sum(logprobs * mask * advantages[:, None]) / jnp.sum(mask)
    return loss, logprobs


@nnx.jit
def train_step(policy: Llama, optimizer: nnx.Optimizer, tokens, mask, advantages):
    grad_fn = nnx.value_and_grad(reinforce_loss, has_aux=True)
    (loss, logprobs), grads = grad_fn(policy, tokens, mask, advantages)
    optimizer.update(policy, grads)
    return loss, logprobs


# -- the loop ------------------------------------------------------------------------------------


def rollouts(llm: jaxserve.LLM, prompts: list[list[int]], iteration: int):
    """Sampled completions: (tokens i32[B, P + MAX_TOKENS] right-padded, completion mask
    f32[B, P + MAX_TOKENS - 1] over the logprob positions, the engine's logprobs there)."""
    batch = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    params = [
        jaxserve.SamplingParams(
            temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, seed=seed
        )
        for seed in range(iteration * len(batch), (iteration + 1) * len(batch))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    width = max(map(len, prompts)) + MAX_TOKENS
    tokens = np.zeros((len(batch), width), np.int32)
    mask = np.zeros((len(batch), width - 1), np.float32)
    engine_logprobs = np.zeros((len(batch), width - 1), np.float32)
    for row, (prompt, output) in enumerate(zip(batch, outputs, strict=True)):
        sample = output.outputs[0]
        ids = list(sample.token_ids)
        tokens[row, : len(prompt) + len(ids)] = prompt + ids
        span = slice(len(prompt) - 1, len(prompt) - 1 + len(ids))
        mask[row, span] = 1.0
        engine_logprobs[row, span] = [
            lp[t].logprob for lp, t in zip(sample.logprobs, ids, strict=True)
        ]
    return tokens, mask, engine_logprobs


def rewards_of(tokens: np.ndarray, mask: np.ndarray, target: int) -> np.ndarray:
    """The fraction of each completion's tokens that are ``target``."""
    is_target = (tokens[:, 1:] == target) * mask
    return is_target.sum(1) / mask.sum(1)


def main(iterations: int = 8, learning_rate: float = 2e-4, seed: int = 0) -> list[dict]:
    """Run the loop; each iteration's mean reward and logprob agreement."""
    start = time.perf_counter()
    llm = jaxserve.LLM(  # the demo model, float32 like the trainer; prefix caching on
        dtype="float32",
        seed=seed,
        max_model_len=64,
        max_num_seqs=len(PROMPTS) * SAMPLES_PER_PROMPT,
        max_num_batched_tokens=128,
        warmup=False,  # compile only the shapes this loop runs
    )
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    (target,) = tokenizer.encode(TARGET, add_special_tokens=False)
    policy = load_policy(DEMO)
    optimizer = nnx.Optimizer(policy, optax.adam(learning_rate), wrt=nnx.Param)
    llm.update_weights(nnx.state(policy, nnx.Param))  # the engine samples the trainer's weights
    history = []
    for iteration in range(iterations):
        tokens, mask, engine_logprobs = rollouts(llm, prompts, iteration)
        rewards = rewards_of(tokens, mask, target)
        advantages = rewards - rewards.mean()
        _, logprobs = train_step(policy, optimizer, tokens, mask, advantages)
        agreement = float(np.max(np.abs(np.asarray(logprobs) - engine_logprobs) * mask))
        llm.update_weights(nnx.state(policy, nnx.Param))
        history.append(
            {"iteration": iteration, "reward": float(rewards.mean()), "agreement": agreement}
        )
        print(
            f"iteration {iteration}: mean reward {rewards.mean():.3f}  "
            f"max |engine - trainer| logprob {agreement:.2e}",
            flush=True,
        )
    print(f"{iterations} iterations in {time.perf_counter() - start:.1f} s")
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8, help="policy-gradient steps")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="Adam's step size")
    args = parser.parse_args()
    main(args.iterations, args.learning_rate)
