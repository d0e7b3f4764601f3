"""Make the speculative-decoding fixtures under ``tests/fixtures/spec/`` from the demo model.

    python scripts/make_spec_fixtures.py            # a few minutes on a CPU

1. **Data.** Prompts are 24-token windows of the Python standard library's source (the demo
   model's training split for training, its held-out files for evaluation); the demo model
   continues each greedily (``jaxserve.LLM``, float32, up to 40 tokens). A teacher pass
   (``decoder.forward_with_aux``) gives, at every position, the target's hidden states entering
   layers ``AUX_LAYERS`` and its greedy next token.
2. **EAGLE-3 head** (``eagle3/``): the published layout (config.json ``LlamaForCausalLMEagle3``,
   ``fc``, ``midlayer.*``, ``norm``, ``lm_head`` over the ``DRAFT_VOCAB`` most frequent greedy
   tokens, ``d2t`` / ``t2d``; no ``embed_tokens``: the demo model's is used). Initialised from
   the demo's last layer (``fc`` picking the highest aux state, the layer's q/k/v reading the
   hidden half), then trained with optax's Adam on the greedy tokens with EAGLE-3's
   training-time test: ``K_STEPS`` chained steps, each step's pre-norm state the next one's
   input, attending to the first step's keys before it and the chain's own keys.
3. **Draft model** (``draft/``): the demo model's embedding, first layer and final norm (one
   layer of four), trained on the same greedy tokens; a plain Llama directory with the demo's
   tokenizer files.
4. **Evaluation** (``eval.json``): the held-out sequences and the acceptance measured through
   the serving code (``eagle3_step`` over paged KV, ``decoder.forward``): top-1 agreement with
   the demo's greedy token, and chains of ``K_STEPS`` drafts from every position of the greedy
   continuations (accepted tokens per chain and each position's acceptance rate).

Deterministic for one machine, Python stdlib and jax version (fixed seeds, CPU).
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from safetensors.numpy import save_file

import jaxserve
from jaxserve.models import decoder
from jaxserve.models.batch import make_kv_cache_for
from jaxserve.models.contiguous_batch import sequences_batch
from jaxserve.models.eagle3 import eagle3_forward, fuse_aux_hidden, make_eagle3_kv_cache
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.eagle3_checkpoint import load_eagle3

sys.path.insert(0, str(Path(__file__).parent))
from make_demo_model import read_corpus  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEMO = Path(jaxserve.__file__).parent / "assets" / "demo"
OUT = REPO / "tests" / "fixtures" / "spec"
AUX_LAYERS = (1, 2, 3)  # the residual stream entering these demo layers (vLLM's numbering)
DRAFT_VOCAB = 1024
PROMPT_LEN, MAX_NEW = 24, 40
NUM_TRAIN, NUM_EVAL = 384, 8
K_STEPS = 3
PAGE = 16
SEED = 0
BATCH_ROWS = 16


# -- data ----------------------------------------------------------------------------------------


def prompts(texts: list[str], tokenizer, num: int, rng: np.random.Generator) -> list[list[int]]:
    """``num`` windows of PROMPT_LEN - 1 tokens after bos, from files drawn at random."""
    out = []
    while len(out) < num:
        ids = tokenizer.encode(texts[rng.integers(len(texts))], add_special_tokens=False)
        if len(ids) > 4 * PROMPT_LEN:
            start = int(rng.integers(len(ids) - PROMPT_LEN))
            out.append([0] + ids[start : start + PROMPT_LEN - 1])
    return out


def continue_greedily(llm, prompt_ids: list[list[int]]) -> list[list[int]]:
    params = jaxserve.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompt_ids, outputs, strict=True)]


def teacher(weights, config, sequences: list[list[int]]):
    """(aux f32[S, T, 3H], greedy i32[S, T] (the target's next token at each position),
    lengths), padded to the longest sequence."""
    width = max(map(len, sequences))
    aux = np.zeros((len(sequences), width, 3 * config.hidden_size), np.float32)
    greedy = np.zeros((len(sequences), width), np.int32)
    pages = -(-width // PAGE)
    for first in range(0, len(sequences), 32):
        chunk = sequences[first : first + 32]
        batch = sequences_batch([(s, 0) for s in chunk], PAGE, pages)
        cache = make_kv_cache_for(config, len(chunk) * pages, PAGE, jnp.float32)
        _, hidden, states = decoder.forward_with_aux(weights, cache, batch, config, AUX_LAYERS)
        ids = np.asarray(jnp.argmax(decoder.compute_logits(weights, hidden), -1))
        joined = np.asarray(jnp.concatenate(states, -1))
        start = 0
        for row, seq in enumerate(chunk, first):
            aux[row, : len(seq)] = joined[start : start + len(seq)]
            greedy[row, : len(seq)] = ids[start : start + len(seq)]
            start += len(seq)
    return aux, greedy, np.asarray([len(s) for s in sequences])


def padded(sequences: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(sequences), width), np.int32)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = seq
    return out


# -- dense training forwards (f32) ---------------------------------------------------------------


def rms(x, w, eps=1e-5):
    return w * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


def rotary(num_positions: int, head_dim: int, theta: float = 10000.0):
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2) / head_dim)
    angles = jnp.arange(num_positions)[:, None] * inv[None, :]
    angles = jnp.concatenate([angles, angles], -1)  # [T, D]
    return jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]  # [T, 1, D]


def rotate(x, cos, sin):  # x [B, T, heads, D]
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def shift_right(x, by: int):  # [B, T, ...]: row t holds x[t - by], zeros before
    if by == 0:
        return x
    return jnp.concatenate([jnp.zeros_like(x[:, :by]), x[:, :-by]], axis=1)


def mlp(p, x):
    return (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


def attention(q, keys):
    """Step j's attention (EAGLE-3's training-time test): ``keys`` = [(k, v, shift)], the first
    step's with a causal mask ending ``shift`` rows back, then one key per later step (its
    row ``t - shift``)."""
    b, t, n, d = q.shape
    kv_heads = keys[0][0].shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, d) / np.sqrt(d)
    k1, v1, shift1 = keys[0]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k1)
    visible = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None] - shift1  # [t, s]
    scores = [jnp.where(visible, scores, -1e30)]
    diag = [(shift_right(k, s), shift_right(v, s)) for k, v, s in keys[1:]]
    scores += [jnp.einsum("btkgd,btkd->bkgt", qg, k)[..., None] for k, _ in diag]
    probs = jax.nn.softmax(jnp.concatenate(scores, -1), -1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v1)
    for i, (_, v) in enumerate(diag):
        out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., t + i], v)
    return out.reshape(b, t, n * d)


def head_steps(p, embed, aux, tokens_next, dims):
    """Draft logits f32[B, T, W] of each of K_STEPS chained steps (row t of step j: the chain
    from anchor t - j + 1)."""
    n, k, d = dims
    b, t, _ = aux.shape
    cos, sin = rotary(t, d)
    emb = rms(embed[tokens_next], p["input_norm"])
    hidden, keys, out = aux @ p["fc"], [], []
    for j in range(K_STEPS):
        x = jnp.concatenate([emb, rms(hidden, p["hidden_norm"])], -1)
        q = rotate((x @ p["wq"]).reshape(b, t, n, d), cos, sin)
        key = rotate((x @ p["wk"]).reshape(b, t, k, d), cos, sin)
        value = (x @ p["wv"]).reshape(b, t, k, d)
        keys.append((key, value))
        first = (keys[0][0], keys[0][1], j)
        later = [(kk, vv, j - m) for m, (kk, vv) in enumerate(keys[1:], 1)]
        residual = hidden + attention(q, [first, *later]) @ p["wo"]
        prenorm = residual + mlp(p, rms(residual, p["post_norm"]))
        out.append(rms(prenorm, p["norm"]) @ p["lm_head"])
        hidden = shift_right(prenorm, 1)
    return out


def draft_logits(p, tokens, dims):
    """The one-layer draft model's logits f32[B, T, V] (tied embedding)."""
    n, k, d = dims
    b, t = tokens.shape
    cos, sin = rotary(t, d)
    x = p["embed"][tokens]
    h = rms(x, p["attn_norm"])
    q = rotate((h @ p["wq"]).reshape(b, t, n, d), cos, sin)
    key = rotate((h @ p["wk"]).reshape(b, t, k, d), cos, sin)
    value = (h @ p["wv"]).reshape(b, t, k, d)
    x = x + attention(q, [(key, value, 0)]) @ p["wo"]
    x = x + mlp(p, rms(x, p["post_norm"]))
    return rms(x, p["norm"]) @ p["embed"].T


# -- initialisation and training -----------------------------------------------------------------


def head_init(weights, config, draft_ids: np.ndarray) -> dict[str, jax.Array]:
    """The head as the demo's last layer on the highest aux state: at step 1 it starts as the
    target's own last layer, final norm and (tied) lm_head over the draft vocabulary."""
    h, last = config.hidden_size, weights.layers[-1]
    fc = jnp.zeros((3 * h, h)).at[2 * h :].set(jnp.eye(h))

    def hidden_half(w):  # [H, heads, D] -> [2H, heads * D], zero on the embedding's half
        w = w.reshape(h, -1)
        return jnp.concatenate([jnp.zeros_like(w), w], 0)

    return {
        "fc": fc,
        "input_norm": jnp.ones(h),
        "hidden_norm": last.attn_norm,
        "wq": hidden_half(last.wq),
        "wk": hidden_half(last.wk),
        "wv": hidden_half(last.wv),
        "wo": last.wo.reshape(-1, h),
        "post_norm": last.mlp_norm,
        "gate": last.w_gate,
        "up": last.w_up,
        "down": last.w_down,
        "norm": weights.final_norm,
        "lm_head": weights.embed[draft_ids].T,
    }


def draft_init(weights) -> dict[str, jax.Array]:
    """The draft model: the demo's embedding, first layer and final norm."""
    first = weights.layers[0]
    h = weights.embed.shape[1]
    return {
        "embed": weights.embed,
        "attn_norm": first.attn_norm,
        "wq": first.wq.reshape(h, -1),
        "wk": first.wk.reshape(h, -1),
        "wv": first.wv.reshape(h, -1),
        "wo": first.wo.reshape(-1, h),
        "post_norm": first.mlp_norm,
        "gate": first.w_gate,
        "up": first.w_up,
        "down": first.w_down,
        "norm": weights.final_norm,
    }


def cross_entropy(logits, labels, mask):
    logprobs = jax.nn.log_softmax(logits, -1)
    picked = jnp.take_along_axis(logprobs, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
    return -jnp.sum(picked * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def train(loss_fn, params, data: dict[str, np.ndarray], steps: int, lr: float, name: str):
    """Adam with a cosine decay over ``steps`` minibatches of BATCH_ROWS rows (fixed order)."""
    optimizer = optax.adam(optax.cosine_decay_schedule(lr, steps))
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(SEED)
    num_rows = len(next(iter(data.values())))
    start = time.perf_counter()
    for i in range(steps):
        rows = rng.choice(num_rows, BATCH_ROWS, replace=False)
        params, state, loss = step(params, state, {k: v[rows] for k, v in data.items()})
        if i % 25 == 0 or i == steps - 1:
            print(f"{name} step {i}: loss {float(loss):.3f} ({time.perf_counter() - start:.0f} s)")
    return params


def head_loss(params, batch, embed, dims):
    logits = head_steps(params, embed, batch["aux"], batch["tokens_next"], dims)
    weights = (1.0, 0.8, 0.64)
    total = 0.0
    for j, step_logits in enumerate(logits):
        mask = batch["valid"] * (jnp.arange(step_logits.shape[1]) >= j)[None, :]
        total = total + weights[j] * cross_entropy(step_logits, batch["labels"], mask)
    return total


def draft_loss(params, batch, dims):
    logits = draft_logits(params, batch["tokens"], dims)
    return cross_entropy(logits, batch["greedy"], batch["mask"])


# -- saving --------------------------------------------------------------------------------------


def bf16(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))


def save_head(params, config, draft_ids: np.ndarray, out: Path) -> int:
    """The head in SpecForge's layout; returns the safetensors file's bytes."""
    out.mkdir(parents=True, exist_ok=True)
    layer = "midlayer."
    tensors = {
        "fc.weight": bf16(params["fc"].T),
        layer + "input_layernorm.weight": bf16(params["input_norm"]),
        layer + "hidden_norm.weight": bf16(params["hidden_norm"]),
        layer + "post_attention_layernorm.weight": bf16(params["post_norm"]),
        **{
            f"{layer}self_attn.{name}_proj.weight": bf16(params[f"w{name}"].T)
            for name in ("q", "k", "v", "o")
        },
        **{
            f"{layer}mlp.{name}_proj.weight": bf16(params[name].T)
            for name in ("gate", "up", "down")
        },
        "norm.weight": bf16(params["norm"]),
        "lm_head.weight": bf16(params["lm_head"].T),
        "d2t": (draft_ids - np.arange(len(draft_ids))).astype(np.int64),
        "t2d": np.isin(np.arange(config.vocab_size), draft_ids),
    }
    save_file(tensors, str(out / "model.safetensors"))
    demo = json.loads((DEMO / "config.json").read_text())
    head_config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **{key: demo[key] for key in ("bos_token_id", "eos_token_id", "head_dim", "hidden_act")},
        **{key: demo[key] for key in ("hidden_size", "intermediate_size", "rms_norm_eps")},
        **{key: demo[key] for key in ("num_attention_heads", "num_key_value_heads")},
        **{key: demo[key] for key in ("max_position_embeddings", "rope_parameters")},
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": len(draft_ids),
        "target_hidden_size": config.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS)},
        "dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(head_config, indent=2) + "\n")
    return (out / "model.safetensors").stat().st_size


def save_draft(params, out: Path) -> int:
    """The draft model as a one-layer Llama directory with the demo's tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": bf16(params["embed"]),
        prefix + "input_layernorm.weight": bf16(params["attn_norm"]),
        **{
            f"{prefix}self_attn.{name}_proj.weight": bf16(params[f"w{name}"].T)
            for name in ("q", "k", "v", "o")
        },
        prefix + "post_attention_layernorm.weight": bf16(params["post_norm"]),
        **{
            f"{prefix}mlp.{name}_proj.weight": bf16(params[name].T)
            for name in ("gate", "up", "down")
        },
        "model.norm.weight": bf16(params["norm"]),
    }
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((DEMO / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / name, out / name)
    return (out / "model.safetensors").stat().st_size


# -- acceptance, measured through the serving code -----------------------------------------------


def chain_stats(accepted: np.ndarray) -> dict:
    """Accepted drafts per chain (0..K_STEPS) -> the mean, and the fraction of chains whose
    j-th draft was accepted (vLLM's per-position acceptance)."""
    return {
        "num_chains": len(accepted),
        "mean_accepted": round(float(accepted.mean()), 4),
        "per_position": [round(float((accepted > j).mean()), 4) for j in range(K_STEPS)],
    }


def anchors(sequences, lengths) -> list[tuple[int, int]]:
    """(sequence, n): the token at n + 1 was just sampled greedily, K_STEPS greedy ones follow."""
    return [
        (s, n) for s, length in enumerate(lengths) for n in range(PROMPT_LEN - 1, length - K_STEPS)
    ]


def head_acceptance(head_dir, weights, config, sequences, aux, greedy, lengths) -> dict:
    hcfg, hw = load_eagle3(head_dir, config, weights.embed, jnp.float32)
    pages = -(-max(lengths) // PAGE)
    rows = [(seq[1:], 0) for seq in sequences]
    batch = sequences_batch(rows, PAGE, pages)
    hidden = fuse_aux_hidden(
        hw, [jnp.concatenate([aux[s, : n - 1] for s, n in enumerate(lengths)])]
    )
    kv = make_eagle3_kv_cache(hcfg, len(rows) * pages, PAGE, jnp.float32)
    _, normed, _ = eagle3_forward(hw, kv, batch, hidden, hcfg)
    top1 = np.asarray(hw.draft_to_target[jnp.argmax(normed @ hw.lm_head, -1)])
    labels = np.concatenate([greedy[s, 1:n] for s, n in enumerate(lengths)])
    chains = anchors(sequences, lengths)
    accepted = head_chains(hw, hcfg, sequences, aux, chains, pages)
    expected = np.asarray([[greedy[s, n + j] for j in range(1, K_STEPS + 1)] for s, n in chains])
    matches = np.cumprod(accepted == expected, axis=1).sum(1)
    return {"top1": round(float((top1 == labels).mean()), 4), "chains": chain_stats(matches)}


def head_chains(hw, hcfg, sequences, aux, chains, pages) -> np.ndarray:
    """i32[chains, K_STEPS]: each chain's drafts, through ``eagle3_step``'s pieces."""
    from jaxserve.models.eagle3 import eagle3_step

    rows = [(sequences[s][1 : n + 2], 0) for s, n in chains]
    batch = sequences_batch(rows, PAGE, pages)
    hidden = fuse_aux_hidden(hw, [jnp.concatenate([aux[s, : n + 1] for s, n in chains])])
    kv = make_eagle3_kv_cache(hcfg, len(rows) * pages, PAGE, jnp.float32)
    drafts = []
    for j in range(K_STEPS):
        kv, logits, prenorm = eagle3_step(hw, kv, batch, hidden, hcfg)
        tokens = np.asarray(jnp.argmax(logits, -1))
        drafts.append(tokens)
        hidden = prenorm[batch.logits_indices]
        batch = sequences_batch(
            [([int(t)], n + 1 + j) for t, (_, n) in zip(tokens, chains, strict=True)], PAGE, pages
        )
    return np.stack(drafts, 1)


def draft_acceptance(draft_dir, sequences, greedy, lengths) -> dict:
    config = load_model_config(draft_dir)
    weights = load_weights(draft_dir, config, jnp.float32)
    pages = -(-max(lengths) // PAGE)
    batch = sequences_batch([(seq, 0) for seq in sequences], PAGE, pages)
    cache = make_kv_cache_for(config, len(sequences) * pages, PAGE, jnp.float32)
    _, hidden = decoder.forward(weights, cache, batch, config)
    ids = np.asarray(jnp.argmax(decoder.compute_logits(weights, hidden), -1))
    agree = ids == np.concatenate([greedy[s, :n] for s, n in enumerate(lengths)])
    starts = np.cumsum([0, *lengths])
    # A greedy draft's chain from n reads the target's greedy tokens for as long as it agrees.
    chains = anchors(sequences, lengths)
    per_chain = np.asarray(
        [agree[starts[s] + n + 1 : starts[s] + n + 1 + K_STEPS] for s, n in chains]
    )
    return {
        "top1": round(float(agree.mean()), 4),
        "chains": chain_stats(np.cumprod(per_chain, 1).sum(1)),
    }


# -- main ----------------------------------------------------------------------------------------


def make_data(config, weights):
    """(train, eval) each: sequences, aux, greedy, lengths."""
    rng = np.random.default_rng(SEED)
    train_files, heldout = read_corpus(Path(sysconfig.get_paths()["stdlib"]))
    llm = jaxserve.LLM(dtype="float32", seed=SEED, max_model_len=128, max_num_seqs=64, warmup=False)
    tokenizer = llm.get_tokenizer()
    train_prompts = prompts(list(train_files.values()), tokenizer, NUM_TRAIN, rng)
    eval_prompts = prompts(list(heldout.values()), tokenizer, NUM_EVAL, rng)
    sets = []
    for ids in (train_prompts, eval_prompts):
        sequences = continue_greedily(llm, ids)
        sets.append((sequences, *teacher(weights, config, sequences)))
    llm.shutdown()
    return sets


def train_head(weights, config, train_set, draft_ids: np.ndarray, steps: int):
    sequences, aux, greedy, lengths = train_set
    width = aux.shape[1]
    to_draft = np.full(config.vocab_size, -1, np.int32)
    to_draft[draft_ids] = np.arange(len(draft_ids))
    labels = to_draft[greedy[:, 1:]]  # row t predicts greedy[t + 1]
    rows = np.arange(width - 1)[None, :]
    data = {
        "aux": aux[:, :-1],
        "tokens_next": padded(sequences, width)[:, 1:],
        "labels": labels,
        "valid": ((rows < (lengths[:, None] - 1)) & (labels >= 0)).astype(np.float32),
    }
    dims = (config.num_q_heads, config.num_kv_heads, config.head_dim)
    embed = weights.embed

    def loss(params, batch):
        return head_loss(params, batch, embed, dims)

    return train(loss, head_init(weights, config, draft_ids), data, steps, 1e-3, "head")


def train_draft(weights, config, train_set, steps: int):
    sequences, _, greedy, lengths = train_set
    width = greedy.shape[1]
    data = {
        "tokens": padded(sequences, width),
        "greedy": greedy,
        "mask": (np.arange(width)[None, :] < lengths[:, None]).astype(np.float32),
    }
    dims = (config.num_q_heads, config.num_kv_heads, config.head_dim)
    return train(
        lambda p, b: draft_loss(p, b, dims), draft_init(weights), data, steps, 3e-4, "draft"
    )


def main(head_steps_: int = 200, draft_steps: int = 150) -> None:
    start = time.perf_counter()
    config = load_model_config(DEMO)
    weights = load_weights(DEMO, config, jnp.float32)
    train_set, eval_set = make_data(config, weights)
    seconds = time.perf_counter() - start
    print(f"data: {len(train_set[0])} + {len(eval_set[0])} sequences ({seconds:.0f} s)")
    counts = np.bincount(
        np.concatenate([g[:n] for g, n in zip(train_set[2], train_set[3], strict=True)]),
        minlength=config.vocab_size,
    )
    draft_ids = np.sort(np.argsort(-counts, kind="stable")[:DRAFT_VOCAB]).astype(np.int64)
    coverage = counts[draft_ids].sum() / counts.sum()
    print(f"draft vocabulary: {DRAFT_VOCAB} ids cover {coverage:.1%} of the greedy tokens")
    head = train_head(weights, config, train_set, draft_ids, head_steps_)
    head_bytes = save_head(head, config, draft_ids, OUT / "eagle3")
    draft = train_draft(weights, config, train_set, draft_steps)
    draft_bytes = save_draft(draft, OUT / "draft")
    sequences, aux, greedy, lengths = eval_set
    measured = {
        "eagle3": head_acceptance(OUT / "eagle3", weights, config, sequences, aux, greedy, lengths),
        "draft_model": draft_acceptance(OUT / "draft", sequences, greedy, lengths),
    }
    report = {
        "prompt_len": PROMPT_LEN,
        "num_speculative_tokens": K_STEPS,
        "aux_layers": list(AUX_LAYERS),
        "bytes": {"eagle3": head_bytes, "draft_model": draft_bytes},
        "measured": measured,
        "sequences": sequences,
    }
    (OUT / "eval.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "sequences"}, indent=1))
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
