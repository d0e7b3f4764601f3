"""Train the demo model shipped in ``jaxserve/assets/demo`` (served when no model is named).

    python scripts/make_demo_model.py [--seed 0] [--steps 400] [--long-steps 40] [--minutes 30]
        [--out DIR] [--hf-python /path/to/python-with-torch]

A small Llama (4 layers, hidden 256, 4 query / 2 KV heads, vocab 4096, tied embeddings,
4.2M parameters) trained on the CPU, in JAX, on the Python standard library's own sources
(``sysconfig.get_paths()["stdlib"]``, so nothing is downloaded). The training forward is a dense
causal attention written here around ``jaxserve.models.decoder``'s ``apply_rope``,
``rope_inv_freq``, ``mlp_block`` and ``compute_logits`` and ``jaxserve.models.layers``'
``rms_norm`` and ``Weights`` pytree, so the trained weights are exactly what the serving
forward consumes (checked at the end against the paged forward). About 20 minutes on 2 CPU cores.

Corpus: every ``*.py`` file under the stdlib directory, sorted by relative path, outside
``EXCLUDED_PARTS`` (tests, codec tables, generated data, vendored packages). Files whose sorted
index is a multiple of ``HELDOUT_EVERY`` are held out for evaluation; the tokenizer, the
unigram baseline and the training documents come from the other files only. Training documents
are the files cut at top-level definitions, their docstrings as prose, and ChatML conversations
made from their docstrings and function sources with ``ast``.

Outputs: the Hugging Face directory (config.json, generation_config.json, model.safetensors in
bf16, tokenizer.json, tokenizer_config.json, chat_template.jinja) and ``eval.json`` (held-out
perplexity against a unigram baseline, a held-out slice for the tests, greedy samples through
``jaxserve.LLM``, the paged-forward check and, with ``--hf-python``, the logits of Hugging Face
transformers on the written directory).

Requirements: only jaxserve's own dependencies (jax, numpy, tokenizers, transformers,
safetensors, ml_dtypes); AdamW is written here. ``--hf-python`` names an interpreter with torch
and transformers for the optional transformers check. The run is deterministic for a given
``--seed``, ``--steps``, Python stdlib and machine; ``--minutes`` is a wall-clock cap that stops
early (and then says so in eval.json).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import transformers
from safetensors.numpy import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxserve.config import ModelConfig
from jaxserve.models import decoder
from jaxserve.models.batch import Batch, make_kv_cache
from jaxserve.models.families.counting import num_params
from jaxserve.models.families.registry import load_model_config, model_config_from_dict
from jaxserve.models.layers import LayerWeights, Weights, rms_norm
from jaxserve.models.loading.checkpoint_loader import load_weights

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "jaxserve" / "assets" / "demo"

EXCLUDED_PARTS = frozenset(
    {
        "test", "tests", "idle_test", "idlelib", "lib2to3", "encodings", "pydoc_data",
        "turtledemo", "site-packages", "dist-packages", "__pycache__", "__phello__",
    }
)  # fmt: skip
HELDOUT_EVERY = 20  # files whose sorted index % 20 == 0 are held out

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
# NOTE: spaces are pre-tokens of their own (runs of spaces stay together for indentation), so a
# prompt ending in a space ("def ", "The ") is tokenized exactly as the same text in training.
# Identifiers keep their underscores ("__init__" can be one token).
PRE_TOKEN_PATTERN = r"[\p{L}\p{N}_]+| +|\n|[^\s\p{L}\p{N}_]+|\s"

# ChatML; starts with bos as the models always see bos first (render chat prompts, then encode
# them with add_special_tokens=False).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant that knows the Python standard library.",
    "Answer questions about Python.",
)
GREETINGS = ("Hello!", "Hi", "Hello, who are you?", "Who are you?", "What can you do?", "Help")
GREETING_REPLY = (
    "Hello! I am a small demo model trained on the Python standard library. Ask me what a "
    "module or a function does, or to write a Python function."
)
NUM_GREETING_COPIES = 50  # of each greeting, with random system prompts
CHAT_FRACTION = 0.25  # at most this share of the training tokens are chat examples
DOCSTRING_FRACTION = 0.1  # and at most this share docstrings on their own (English prose)
TOP_LEVEL_STARTS = ("def ", "async def ", "class ", "@", "if __name__")  # cut files before these
MAX_ANSWER_CHARS = 700
MAX_CODE_CHARS = 900
HF_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
)  # fmt: skip
SLICE_TOKENS = 256  # the held-out slice the tests recompute

SAMPLE_PROMPTS = ("def ", "import ", "The ", "class ", "    def __init__(self", "# ")
SAMPLE_CHATS = (
    "Hello!",
    "What does `os.path.join` do?",
    "What is the `json` module for?",
    "Write a Python function `add(a, b)`. Return the sum of a and b.",
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 400  # in all, the last long_steps of them on max_position_embeddings windows
    long_steps: int = 40
    minutes: float = 30.0  # wall-clock cap on training (stops early, and says so)
    batch_size: int = 8
    seq_len: int = 512
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    init_std: float = 0.02
    eval_every: int = 50

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "warmup_steps", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0 <= self.long_steps < self.steps:
            raise ValueError(f"long_steps={self.long_steps} must be in [0, steps={self.steps})")
        if self.minutes <= 0:
            raise ValueError(f"minutes={self.minutes} must be positive")


def hf_config(tok: transformers.PreTrainedTokenizerFast) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )


# -- corpus -----------------------------------------------------------------------------------


def corpus_files(root: Path) -> list[Path]:
    """The corpus: stdlib ``*.py`` files outside EXCLUDED_PARTS, sorted by relative path."""
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not set(p.relative_to(root).parts) & EXCLUDED_PARTS
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_corpus(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(training files, held-out files): relative path -> text."""
    train, heldout = {}, {}
    for index, path in enumerate(corpus_files(root)):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(root).as_posix()
        (heldout if index % HELDOUT_EVERY == 0 else train)[rel] = text
    return train, heldout


def code_chunks(text: str) -> list[str]:
    """A file cut before each top-level definition (decorators and all), as training documents.

    NOTE: documents start with bos, so cutting files this way makes "bos, then def / class /
    import" common in training: a plain completion prompt ("def ") reads like a document start.
    """
    chunks: list[list[str]] = [[]]
    previous = ""
    for line in text.splitlines(keepends=True):
        is_start = line.startswith(TOP_LEVEL_STARTS) and not previous.startswith("@")
        if is_start and any(x.strip() for x in chunks[-1]):
            chunks.append([])
        chunks[-1].append(line)
        if line.strip():
            previous = line
    return ["".join(c).rstrip("\n") + "\n" for c in chunks if any(x.strip() for x in c)]


def docstrings(files: dict[str, str]) -> list[str]:
    """Module, class and function docstrings of at least 80 characters, as plain text."""
    found = []
    for text in files.values():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in [tree, *(node for _, node in definitions(tree))]:
            doc = ast.get_docstring(node)  # type: ignore[arg-type]
            if doc and len(doc) >= 80:
                found.append(doc.strip() + "\n")
    return found


def module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def conversation(question: str, answer: str, rng: random.Random) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": question})
    messages.append({"role": "assistant", "content": answer})
    return messages


def definitions(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """Public module-level functions and classes, and the public methods of those classes."""
    found: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            found.append((node.name, node))
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    is_method = isinstance(item, ast.FunctionDef)
                    if is_method and (not item.name.startswith("_") or item.name == "__init__"):
                        found.append((f"{node.name}.{item.name}", item))
    return found


def chat_examples(files: dict[str, str], rng: random.Random) -> list[list[dict[str, str]]]:
    """Questions about the training files' modules, functions and classes, answered from them."""
    examples = [
        conversation(greeting, GREETING_REPLY, rng)
        for greeting in GREETINGS
        for _ in range(NUM_GREETING_COPIES)
    ]
    for rel, text in files.items():
        module = module_name(rel)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        doc = ast.get_docstring(tree)
        if doc and 20 <= len(first_paragraph(doc)) <= MAX_ANSWER_CHARS:
            question = rng.choice(
                (f"What is the `{module}` module for?", f"What does the `{module}` module do?")
            )
            examples.append(conversation(question, first_paragraph(doc), rng))
        for qualname, node in definitions(tree):
            doc = ast.get_docstring(node)  # type: ignore[arg-type]
            if not doc:
                continue
            summary = first_paragraph(doc)
            source = ast.get_source_segment(text, node)
            is_function = isinstance(node, ast.FunctionDef)
            if is_function and source and len(source) <= MAX_CODE_CHARS and rng.random() < 0.4:
                code = textwrap.dedent(" " * node.col_offset + source)  # type: ignore[attr-defined]
                args = ast.unparse(node.args)  # type: ignore[attr-defined]
                first_line = doc.strip().splitlines()[0]
                question = f"Write a Python function `{qualname.split('.')[-1]}({args})`."
                examples.append(
                    conversation(f"{question} {first_line}", f"```python\n{code}\n```", rng)
                )
            elif 20 <= len(summary) <= MAX_ANSWER_CHARS:
                noun = "function" if is_function else "class"
                question = rng.choice(
                    (
                        f"What does `{module}.{qualname}` do?",
                        f"What does the `{qualname}` {noun} in `{module}` do?",
                        f"Explain `{module}.{qualname}`.",
                    )
                )
                examples.append(conversation(question, summary, rng))
    return examples


# -- tokenizer --------------------------------------------------------------------------------


def build_tokenizer(texts: list[str]) -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE over the training files: every string round-trips, encode prepends bos."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab_size={tok.get_vocab_size()} != {VOCAB_SIZE=}")
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    hf.chat_template = CHAT_TEMPLATE
    for text in texts[:50]:
        if hf.decode(hf(text)["input_ids"], skip_special_tokens=True) != text:
            raise RuntimeError(f"tokenizer does not round-trip {text[:40]!r}")
    return hf


def encode_texts(tok: transformers.PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    """Each text as bos + tokens + eos."""
    eos = tok.eos_token_id
    return [ids + [eos] for ids in tok(texts)["input_ids"]]


def encode_chats(
    tok: transformers.PreTrainedTokenizerFast, chats: list[list[dict[str, str]]]
) -> list[list[int]]:
    rendered = [tok.apply_chat_template(c, tokenize=False) for c in chats]
    return tok(rendered, add_special_tokens=False)["input_ids"]


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:  # i32[N] -> i32[W, seq_len + 1]
    """Consecutive windows of seq_len + 1 tokens, overlapping by one (every token a target)."""
    num = (len(stream) - 1) // seq_len
    index = np.arange(num)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[index]


# -- model ------------------------------------------------------------------------------------


def init_weights(config: ModelConfig, std: float, key: jax.Array) -> Weights:
    """Normal(0, std) matrices, output projections scaled by 1/sqrt(2 * layers), unit norms."""
    n, k, d, h = config.num_q_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    i, v = config.intermediate_size, config.vocab_size
    out_std = std / math.sqrt(2 * config.num_layers)
    keys = iter(jax.random.split(key, 1 + 7 * config.num_layers))

    def normal(shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    embed = normal((v, h), std)
    layers = [
        LayerWeights(
            attn_norm=jnp.ones((h,), jnp.float32),
            wq=normal((h, n, d), std),
            wk=normal((h, k, d), std),
            wv=normal((h, k, d), std),
            wo=normal((n, d, h), out_std),
            mlp_norm=jnp.ones((h,), jnp.float32),
            w_gate=normal((h, i), std),
            w_up=normal((h, i), std),
            w_down=normal((i, h), out_std),
        )
        for _ in range(config.num_layers)
    ]
    return Weights(embed=embed, layers=layers, final_norm=jnp.ones((h,), jnp.float32), lm_head=None)


def dense_hidden(
    weights: Weights, tokens: jax.Array, config: ModelConfig
) -> jax.Array:  # i32[B, T] -> f32[B * T, H]
    """The serving model's math for B sequences, with dense causal attention instead of pages.

    Tokens are flattened to rows ([B * T, H]) so the projections are single large GEMMs, as in
    the serving forward; only the attention itself is per sequence.
    """
    b, t = tokens.shape
    eps, d = config.rms_norm_eps, config.head_dim
    kv, group = config.num_kv_heads, config.num_q_heads // config.num_kv_heads
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)  # i32[B * T]
    inv_freq = decoder.rope_inv_freq(config)  # f32[D // 2]
    causal = jnp.tril(jnp.ones((t, t), bool))  # bool[T, S]
    x = weights.embed[tokens.reshape(-1)]  # f32[B * T, H]
    for lw in weights.layers:
        h = rms_norm(x, lw.attn_norm, eps)
        q = decoder.apply_rope(jnp.einsum("TH,HND->TND", h, lw.wq), positions, inv_freq)
        k = decoder.apply_rope(jnp.einsum("TH,HKD->TKD", h, lw.wk), positions, inv_freq)
        v = jnp.einsum("TH,HKD->TKD", h, lw.wv)  # f32[B * T, K, D]
        q = q.reshape(b, t, kv, group, d)  # query head n uses kv head n // group
        k, v = k.reshape(b, t, kv, d), v.reshape(b, t, kv, d)
        scores = jnp.einsum("BTKGD,BSKD->BKGTS", q, k) * d**-0.5  # f32[B, K, G, T, S]
        scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v).reshape(b * t, -1, d)  # f32[BT, N, D]
        x = x + jnp.einsum("TND,NDH->TH", out, lw.wo)
        x = x + decoder.mlp_block(lw, rms_norm(x, lw.mlp_norm, eps))
    return rms_norm(x, weights.final_norm, eps)


def batch_nll(
    weights: Weights, batch: jax.Array, config: ModelConfig
) -> jax.Array:  # i32[B, T + 1] -> f32[B, T]
    """Next-token negative log-likelihood of every position of every window."""
    logits = decoder.compute_logits(weights, dense_hidden(weights, batch[:, :-1], config))
    targets = batch[:, 1:].reshape(-1)  # i32[B * T]
    gold = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]  # f32[B * T]
    return (jax.nn.logsumexp(logits, axis=-1) - gold).reshape(batch.shape[0], -1)


# -- optimizer --------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AdamState:
    mu: Weights  # first moments, f32, shaped like the weights
    nu: Weights  # second moments


def learning_rate(step: jax.Array, cfg: TrainConfig) -> jax.Array:
    """Linear warm-up, then cosine decay to min_lr_ratio * peak_lr at cfg.steps."""
    warm = cfg.peak_lr * (step + 1) / cfg.warmup_steps
    progress = jnp.clip((step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1), 0, 1)
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return jnp.where(step < cfg.warmup_steps, warm, cfg.peak_lr * cosine)


@functools.partial(jax.jit, static_argnums=(4, 5), donate_argnums=(0, 1))
def train_step(
    weights: Weights,  # f32 master weights
    state: AdamState,
    batch: jax.Array,  # i32[B, T + 1]
    step: jax.Array,  # i32[]
    config: ModelConfig,
    cfg: TrainConfig,
) -> tuple[Weights, AdamState, jax.Array, jax.Array]:
    """One AdamW step (decoupled weight decay on matrices only, global-norm clipping).

    NOTE: the forward runs in bf16 (logits, softmax and loss in f32) from f32 master weights:
    on this CPU it is ~1.8x faster than f32 and the same precision the model is served in on
    accelerators.
    """

    def loss_fn(w: Weights) -> jax.Array:
        return batch_nll(jax.tree.map(lambda a: a.astype(jnp.bfloat16), w), batch, config).mean()

    loss, grads = jax.value_and_grad(loss_fn)(weights)
    grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, cfg.grad_clip / (grad_norm + 1e-6)), grads)
    t = (step + 1).astype(jnp.float32)
    lr = learning_rate(step, cfg)
    mu = jax.tree.map(lambda m, g: cfg.beta1 * m + (1 - cfg.beta1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: cfg.beta2 * v + (1 - cfg.beta2) * g * g, state.nu, grads)

    def update(w: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
        m_hat, v_hat = m / (1 - cfg.beta1**t), v / (1 - cfg.beta2**t)
        decay = cfg.weight_decay if w.ndim >= 2 else 0.0
        return w - lr * (m_hat / (jnp.sqrt(v_hat) + 1e-8) + decay * w)

    return jax.tree.map(update, weights, mu, nu), AdamState(mu, nu), loss, grad_norm


@functools.partial(jax.jit, static_argnums=(2,))
def eval_nll(weights: Weights, batch: jax.Array, config: ModelConfig) -> jax.Array:
    return batch_nll(weights, batch, config)  # f32[B, T]


def position_nll(
    weights: Weights, wins: np.ndarray, config: ModelConfig, batch_size: int
) -> np.ndarray:  # i32[W, T + 1] -> f64[T]
    """Mean NLL at each position over all windows (a partial last batch is padded, then cut)."""
    total = np.zeros(wins.shape[1] - 1)
    for start in range(0, len(wins), batch_size):
        chunk = wins[start : start + batch_size]
        padded = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - len(chunk), axis=0)])
        nll = np.asarray(eval_nll(weights, jnp.asarray(padded), config))  # f32[B, T]
        total += nll[: len(chunk)].sum(axis=0)
    return total / len(wins)


def unigram_nll(counts: np.ndarray, targets: np.ndarray) -> float:
    """Mean NLL of targets under add-one smoothed token frequencies."""
    logp = np.log((counts + 1.0) / (counts.sum() + len(counts)))  # f64[V]
    return float(-logp[targets].mean())


def batches(wins: np.ndarray, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Batches of windows, each epoch in a fresh random order."""
    while True:
        order = rng.permutation(len(wins))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield wins[order[start : start + batch_size]]


# -- output -----------------------------------------------------------------------------------


def hf_tensors(weights: Weights, config: ModelConfig) -> dict[str, np.ndarray]:
    """Weights -> HF tensor names and layouts (the inverse of the checkpoint loader,
    jaxserve.models.loading.checkpoint_loader)."""
    h = config.hidden_size
    out = {
        "model.embed_tokens.weight": weights.embed,
        "model.norm.weight": weights.final_norm,
    }
    for i, lw in enumerate(weights.layers):
        prefix = f"model.layers.{i}."
        out |= {
            prefix + "input_layernorm.weight": lw.attn_norm,
            prefix + "self_attn.q_proj.weight": lw.wq.reshape(h, -1).T,
            prefix + "self_attn.k_proj.weight": lw.wk.reshape(h, -1).T,
            prefix + "self_attn.v_proj.weight": lw.wv.reshape(h, -1).T,
            prefix + "self_attn.o_proj.weight": lw.wo.reshape(-1, h).T,
            prefix + "post_attention_layernorm.weight": lw.mlp_norm,
            prefix + "mlp.gate_proj.weight": lw.w_gate.T,
            prefix + "mlp.up_proj.weight": lw.w_up.T,
            prefix + "mlp.down_proj.weight": lw.w_down.T,
        }
    return {
        name: np.ascontiguousarray(np.asarray(t, np.float32).astype(ml_dtypes.bfloat16))
        for name, t in out.items()
    }


def write_model_dir(
    out: Path, weights: Weights, config: ModelConfig, tok, hf_cfg: transformers.LlamaConfig
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in HF_FILES:
        (out / name).unlink(missing_ok=True)
    hf_cfg.save_pretrained(out)
    transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=tok.pad_token_id,
    ).save_pretrained(out)
    save_file(hf_tensors(weights, config), out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    tok.save_pretrained(out)


def paged_logits(
    weights: Weights, config: ModelConfig, token_ids: list[int]
) -> np.ndarray:  # f32[T, V]
    """All-position logits of one sequence through the serving forward (paged KV cache)."""
    page, num_tokens = 16, len(token_ids)
    num_pages = -(-num_tokens // page)
    cache = make_kv_cache(
        config.num_layers, num_pages, page, config.num_kv_heads, config.head_dim, jnp.float32
    )
    positions = np.arange(num_tokens, dtype=np.int32)
    batch = Batch(
        input_ids=jnp.asarray(token_ids, jnp.int32),
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(positions),
        kv_lens=jnp.asarray([num_tokens], jnp.int32),
        page_indices=jnp.arange(num_pages, dtype=jnp.int32)[None, :],
        cu_q_lens=jnp.asarray([0, num_tokens], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        logits_indices=jnp.asarray([num_tokens - 1], jnp.int32),
    )
    _, hidden = jax.jit(decoder.forward, static_argnums=(3,))(weights, cache, batch, config)
    return np.asarray(decoder.compute_logits(weights, hidden))


HF_SNIPPET = """
import sys, numpy as np, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = torch.tensor([[int(t) for t in sys.argv[2].split(",")]])
with torch.no_grad():
    np.save(sys.argv[3], model(ids).logits[0].numpy())
print(type(model).__name__, transformers.__version__, torch.__version__)
"""


def hf_check(hf_python: str, out: Path, token_ids: list[int], ours: np.ndarray) -> dict:
    """Logits of transformers' AutoModelForCausalLM on the written directory against ours."""
    with tempfile.TemporaryDirectory() as tmp:
        npy = Path(tmp) / "logits.npy"
        ids = ",".join(map(str, token_ids))
        done = subprocess.run(
            [hf_python, "-c", HF_SNIPPET, str(out), ids, str(npy)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        theirs = np.load(npy)
    return {
        "loaded_as": done.stdout.strip().splitlines()[-1],
        "num_tokens": len(token_ids),
        "max_abs_logit_diff": float(np.abs(theirs - ours).max()),
        "same_argmax": bool((theirs.argmax(-1) == ours.argmax(-1)).all()),
    }


def greedy_samples(out: Path) -> list[dict[str, str]]:
    """Greedy continuations through jaxserve.LLM on the written directory."""
    import jaxserve

    llm = jaxserve.LLM(
        str(out), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
        num_gpu_blocks_override=128,
    )  # fmt: skip
    params = jaxserve.SamplingParams(temperature=0.0, max_tokens=64)
    samples = []
    for prompt, result in zip(
        SAMPLE_PROMPTS, llm.generate(list(SAMPLE_PROMPTS), params, use_tqdm=False), strict=True
    ):
        samples.append({"prompt": prompt, "completion": result.outputs[0].text})
    chats = [[{"role": "user", "content": q}] for q in SAMPLE_CHATS]
    for chat, result in zip(chats, llm.chat(chats, params, use_tqdm=False), strict=True):
        samples.append({"chat": chat[0]["content"], "completion": result.outputs[0].text})
    return samples


# -- main -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Corpus:
    tok: transformers.PreTrainedTokenizerFast
    train: dict[str, str]  # relative path -> text
    heldout: dict[str, str]
    stream: np.ndarray  # i32[N] training tokens: text files and chat examples, shuffled
    heldout_stream: np.ndarray  # i32[M] held-out files, in order
    counts: np.ndarray  # i64[V] token frequencies of the training files
    num_code_tokens: int
    num_docstring_tokens: int
    num_chat_tokens: int
    num_chats: int  # conversations kept
    num_chats_made: int


def take_share(docs: list[list[int]], num_tokens: float) -> list[list[int]]:
    """The first documents that fit in num_tokens."""
    kept: list[list[int]] = []
    for doc in docs:
        if num_tokens < len(doc):
            break
        kept.append(doc)
        num_tokens -= len(doc)
    return kept


def make_corpus(seed: int) -> Corpus:
    """Training documents: code chunks, docstrings and chat examples, shuffled into one stream."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = read_corpus(root)
    tok = build_tokenizer(list(train.values()))
    rng = random.Random(seed)
    chats = chat_examples(train, rng)
    code_docs = encode_texts(tok, [c for text in train.values() for c in code_chunks(text)])
    num_code = sum(map(len, code_docs))
    doc_docs = encode_texts(tok, docstrings(train))
    chat_docs = encode_chats(tok, chats)
    rng.shuffle(doc_docs)
    rng.shuffle(chat_docs)
    rest = 1 - CHAT_FRACTION - DOCSTRING_FRACTION
    doc_docs = take_share(doc_docs, DOCSTRING_FRACTION / rest * num_code)
    chat_docs = take_share(chat_docs, CHAT_FRACTION / rest * num_code)
    docs = code_docs + doc_docs + chat_docs
    rng.shuffle(docs)
    return Corpus(
        tok=tok,
        train=train,
        heldout=heldout,
        stream=np.concatenate(docs).astype(np.int32),
        heldout_stream=np.concatenate(encode_texts(tok, list(heldout.values()))).astype(np.int32),
        counts=np.bincount(
            np.concatenate(encode_texts(tok, list(train.values()))), minlength=VOCAB_SIZE
        ),
        num_code_tokens=num_code,
        num_docstring_tokens=sum(map(len, doc_docs)),
        num_chat_tokens=sum(map(len, chat_docs)),
        num_chats=len(chat_docs),
        num_chats_made=len(chats),
    )


def train(
    cfg: TrainConfig, config: ModelConfig, corpus: Corpus
) -> tuple[Weights, int, list[dict[str, float]], float]:
    """(f32 weights, steps done, learning curve, minutes)."""
    weights = init_weights(config, cfg.init_std, jax.random.key(cfg.seed))
    state = AdamState(jax.tree.map(jnp.zeros_like, weights), jax.tree.map(jnp.zeros_like, weights))
    data_rng = np.random.default_rng(cfg.seed)
    long_len = config.max_position_embeddings
    short = batches(windows(corpus.stream, cfg.seq_len), cfg.batch_size, data_rng)
    long = batches(
        windows(corpus.stream, long_len), max(1, cfg.batch_size * cfg.seq_len // long_len), data_rng
    )
    probe_wins = windows(corpus.heldout_stream, cfg.seq_len)
    probe = probe_wins[np.linspace(0, len(probe_wins) - 1, 4 * cfg.batch_size).astype(int)]
    curve, losses, step = [], [], 0
    started = time.perf_counter()
    while step < cfg.steps:
        batch = next(long if step >= cfg.steps - cfg.long_steps else short)
        weights, state, loss, grad_norm = train_step(
            weights, state, jnp.asarray(batch), jnp.asarray(step, jnp.int32), config, cfg
        )
        losses.append(float(loss))
        step += 1
        minutes = (time.perf_counter() - started) / 60
        is_over = minutes > cfg.minutes
        if step % cfg.eval_every == 0 or step == cfg.steps or is_over:
            probe_nll = float(position_nll(weights, probe, config, cfg.batch_size).mean())
            train_nll = float(np.mean(losses[-cfg.eval_every :]))
            curve.append({"step": step, "train_nll": round(train_nll, 4),
                          "heldout_probe_nll": round(probe_nll, 4)})  # fmt: skip
            print(
                f"step {step:5d}  train {train_nll:.3f}  held-out probe {probe_nll:.3f}  "
                f"|g| {float(grad_norm):.2f}  {minutes:.1f} min",
                flush=True,
            )
        if is_over:
            print(f"stopping at step {step}: --minutes {cfg.minutes} reached")
            break
    return weights, step, curve, (time.perf_counter() - started) / 60


def heldout_slice(heldout: dict[str, str]) -> dict[str, str]:
    """40 lines from the middle of the first held-out file of at least 200 lines."""
    for rel, text in heldout.items():
        lines = text.splitlines(keepends=True)
        if len(lines) >= 200:
            start = len(lines) // 2
            return {"file": rel, "lines": f"{start + 1}-{start + 40}",
                    "text": "".join(lines[start : start + 40])}  # fmt: skip
    raise RuntimeError("no held-out file has 200 lines")


def evaluate(
    out: Path, corpus: Corpus, cfg: TrainConfig, hf_python: str | None
) -> dict[str, object]:
    """Held-out NLL of the written (bf16) weights, served in f32, against the unigram baseline."""
    config = load_model_config(out)
    weights = load_weights(out, config, jnp.float32)
    wins = windows(corpus.heldout_stream, config.max_position_embeddings)
    per_position = position_nll(weights, wins, config, 4)  # f64[T]
    model_nll = float(per_position.mean())
    base_nll = unigram_nll(corpus.counts, wins[:, 1:].reshape(-1))
    bytes_per_token = sum(len(t.encode()) for t in corpus.heldout.values()) / len(
        corpus.heldout_stream
    )
    buckets = [(0, 128), (128, 512), (512, config.max_position_embeddings)]

    piece = heldout_slice(corpus.heldout)
    ids = corpus.tok(piece["text"])["input_ids"][: SLICE_TOKENS + 1]
    slice_nll = float(np.asarray(batch_nll(weights, jnp.asarray([ids]), config)).mean())
    paged = paged_logits(weights, config, ids[:-1])  # f32[T, V]
    dense = np.asarray(
        decoder.compute_logits(weights, dense_hidden(weights, jnp.asarray([ids[:-1]]), config))
    )  # f32[T, V]
    report: dict[str, object] = {
        "heldout": {
            "num_tokens": int(wins[:, 1:].size),
            "window": config.max_position_embeddings,
            "bytes_per_token": round(bytes_per_token, 4),
            "model_nll": round(model_nll, 4),
            "model_ppl": round(math.exp(model_nll), 2),
            "unigram_nll": round(base_nll, 4),
            "unigram_ppl": round(math.exp(base_nll), 2),
            "model_bits_per_byte": round(model_nll / math.log(2) / bytes_per_token, 4),
            "unigram_bits_per_byte": round(base_nll / math.log(2) / bytes_per_token, 4),
            "model_nll_by_position": {
                f"{lo}-{hi - 1}": round(float(per_position[lo:hi].mean()), 4) for lo, hi in buckets
            },
        },
        "slice": piece
        | {
            "num_tokens": len(ids),
            "model_nll": round(slice_nll, 4),
            "unigram_nll": round(unigram_nll(corpus.counts, np.asarray(ids[1:])), 4),
        },
        "paged_vs_dense_max_abs_logit_diff": float(np.abs(paged - dense).max()),
    }
    if hf_python:
        report["transformers_check"] = hf_check(hf_python, out, ids[:-1], paged)
    report["samples"] = greedy_samples(out)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(TrainConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=field.default)  # fmt: skip
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--hf-python", help="an interpreter with torch, for the transformers check")
    args = parser.parse_args()
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # BPE training must not depend on threads
    started = time.perf_counter()

    corpus = make_corpus(cfg.seed)
    hf_cfg = hf_config(corpus.tok)
    config = model_config_from_dict(hf_cfg.to_dict())
    num_text = int(corpus.counts.sum())
    print(
        f"{len(corpus.train)} training files ({num_text} tokens), {len(corpus.heldout)} held out;"
        f" training tokens: {corpus.num_code_tokens} code + {corpus.num_docstring_tokens} "
        f"docstrings + {corpus.num_chat_tokens} chat ({corpus.num_chats}/"
        f"{corpus.num_chats_made} conversations), held out {len(corpus.heldout_stream)}; "
        f"{num_params(config):,} parameters ({time.perf_counter() - started:.0f}s)",
        flush=True,
    )
    weights, steps_done, curve, train_minutes = train(cfg, config, corpus)
    write_model_dir(args.out, weights, config, corpus.tok, hf_cfg)
    report = {
        "seed": cfg.seed,
        "train_config": dataclasses.asdict(cfg),
        "steps_done": steps_done,
        "train_minutes": round(train_minutes, 2),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "num_params": num_params(config),
        "corpus": {
            "num_training_files": len(corpus.train),
            "num_heldout_files": len(corpus.heldout),
            "heldout_files": list(corpus.heldout),
            "training_file_tokens": num_text,
            "training_tokens_code": corpus.num_code_tokens,
            "training_tokens_docstrings": corpus.num_docstring_tokens,
            "training_tokens_chat": corpus.num_chat_tokens,
            "num_chat_examples": corpus.num_chats,
            "tokens_seen": steps_done * cfg.batch_size * cfg.seq_len,
        },
        "curve": curve,
    } | evaluate(args.out, corpus, cfg, args.hf_python)
    report["unigram_counts"] = corpus.counts.tolist()
    (args.out / "eval.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    skip = ("unigram_counts", "corpus", "slice", "train_config")
    print(json.dumps({k: v for k, v in report.items() if k not in skip}, indent=1,
                     ensure_ascii=False))  # fmt: skip
    total_minutes = (time.perf_counter() - started) / 60
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB) in {total_minutes:.1f} min")


if __name__ == "__main__":
    main()
