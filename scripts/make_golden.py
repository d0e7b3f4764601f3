"""Build the golden parity fixtures under ``tests/fixtures/models/`` and the built-in 8B configs.

Run with an interpreter that has torch (CPU is enough) and transformers:

    python scripts/make_golden.py

    python scripts/make_golden.py gemma2 phi3   # only these fixtures (and the built-in configs)

One byte-level BPE tokenizer is trained on ``CORPUS`` and shared by tiny random fp32 models built
with transformers' own classes (llama, llama3, qwen2, qwen3, mistral, then the newer families
and rope scalings: gemma2, gemma3, phi3, llama_linear, llama_dynamic, qwen2_yarn). Each model
directory gets the HF files (config.json, generation_config.json, model.safetensors, tokenizer
files) and a ``golden.npz`` with the eager-attention logits the jax model must reproduce; the
newer ones also hold a long greedy generation (``long_*``) from the long prompt, past their
sliding window and their original rope context. The output is deterministic: the same
torch/transformers versions write the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "models"
BUILTIN_CONFIGS = REPO / "jaxserve" / "assets" / "configs"

VOCAB_SIZE = 320
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
NUM_GREEDY = 8
NUM_LONG = 20  # greedy steps after the long prompt (56 tokens): positions 56..75
ORIGINAL_CONTEXT = 64  # the rope-scaled fixtures' original context, crossed by the long run
SLIDING_WINDOW = 16  # the sliding-window fixtures' window, shorter than both prompts
# The fixtures with a long generation in golden.npz.
LONG_FIXTURES = (
    "gemma2",
    "gemma3",
    "phi3",
    "llama_linear",
    "llama_dynamic",
    "qwen2_yarn",
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "gpt_oss",
    "deepseek_v3",
)
MIN_MARGIN = 0.1  # top-1 minus top-2 logit at every greedy step
LONG_MIN_MARGIN = 0.02  # the same over the long generation (fp32 parity is within 1e-4)
MAX_SEED_TRIES = 256

# NOTE: the template starts with bos_token (as Llama-3's does) because the models always see bos
# first; render chat prompts with add_special_tokens=False so bos is not added twice.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The serving engine keeps every request in a queue. At each step the scheduler picks the requests
that fit in the cache, runs one forward pass over all of them, and samples one new token for each.
A request that reaches its stop token or its length limit leaves the batch, and a waiting request
takes its place. The key and value cache is split into pages of sixteen tokens, so a long prompt
uses many pages and a short one uses few. Nothing is copied when a request grows: the engine only
appends a new page to the request's page table.

The quick brown fox jumps over the lazy dog. A naïve café in Zürich serves crème brûlée; the
menu also lists 日本語 and 中文 dishes, and the waiter smiles 🙂 at every guest. Prices are
given in € and £, and the wine list runs from 2019 to 2023.

Attention reads the keys and values of every earlier token. Rotary position embeddings turn the
query and the key by an angle that grows with the position, so the score between two tokens
depends on their distance. Grouped query attention lets several query heads share one key head,
which makes the cache smaller and the decode step faster.

def attention(q, k, v, mask):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v

for step in range(max_new_tokens):
    logits = model(input_ids, positions)
    next_token = int(logits[-1].argmax())
    if next_token == eos_token_id:
        break
    output.append(next_token)

{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
"""

PROMPT = "The scheduler picks the requests that fit."
PROMPT2 = "A long prompt uses many pages: the engine appends a new page when the request grows 🙂."
CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! How big is a page?"},
]


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE trained on CORPUS: any text round-trips, ``tokenizer(text)`` prepends bos."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
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
    )
    hf.chat_template = CHAT_TEMPLATE
    for text in (CORPUS, PROMPT, PROMPT2):
        if hf.decode(hf(text)["input_ids"], skip_special_tokens=True) != text:
            raise RuntimeError(f"tokenizer does not round-trip {text[:40]!r}")
    return hf


def model_configs(
    tok: transformers.PreTrainedTokenizerFast,
) -> dict[str, transformers.PretrainedConfig]:
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    # NOTE: with head_dim 16 and theta 5e5 the rotary wavelengths are 6.3, 32.6, 169, ... tokens.
    # original_max_position_embeddings=64 puts them on all three llama3 branches: below 64/4
    # (unscaled), between 16 and 64 (smoothly interpolated) and above 64 (divided by factor).
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    small = {**common, "num_hidden_layers": 3}
    gemma = dict(
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=24,
        sliding_window=SLIDING_WINDOW,
        tie_word_embeddings=True,
    )
    return {
        "llama": transformers.LlamaConfig(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
        "llama3": transformers.LlamaConfig(
            **common, rope_parameters=llama3_rope, tie_word_embeddings=False
        ),
        "qwen2": transformers.Qwen2Config(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
        ),
        "qwen3": transformers.Qwen3Config(
            **common,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
        ),
        "mistral": transformers.MistralConfig(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            sliding_window=None,
        ),
        # Local (sliding) and global layers alternate; both soft caps are small enough to bend.
        "gemma2": transformers.Gemma2Config(
            **common,
            **gemma,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0,
        ),
        # Two local layers, then a global one with its own rope base and a linear scaling.
        "gemma3": transformers.Gemma3TextConfig(
            **small,
            **gemma,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        ),
        # Fused qkv and gate_up; longrope past 64 positions; a sliding window on every layer.
        "phi3": transformers.Phi3Config(
            **{**common, "max_position_embeddings": 256},
            original_max_position_embeddings=ORIGINAL_CONTEXT,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0],
            },
            sliding_window=SLIDING_WINDOW,
            tie_word_embeddings=False,
        ),
        "llama_linear": transformers.LlamaConfig(
            **common,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            tie_word_embeddings=False,
        ),
        # Dynamic NTK counts from max_position_embeddings: the long run passes it.
        "llama_dynamic": transformers.LlamaConfig(
            **{**common, "max_position_embeddings": ORIGINAL_CONTEXT},
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            tie_word_embeddings=False,
        ),
        "qwen2_yarn": transformers.Qwen2Config(
            **common,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL_CONTEXT,
            },
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
        ),
        # Mixtures of experts, top-2 routing. Mixtral: 4 experts on every layer, the picked
        # weights renormalized. Qwen3-MoE: 8 experts of intermediate 16, raw softmax weights
        # (norm_topk_prob false), layer 1 a dense MLP (mlp_only_layers).
        "mixtral": transformers.MixtralConfig(
            **{**common, "intermediate_size": 32},
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            sliding_window=None,
        ),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **small,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
        ),
        # A shared expert (intermediate 48) behind its sigmoid gate beside 4 routed experts,
        # top-2; experts on every second layer (decoder_sparse_step 2: layer 1), q/k/v biases.
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **common,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=None,
        ),
        # Attention sinks, sliding / full / sliding layers, q/k/v/o biases, yarn (GPT-OSS's
        # scaling, truncate false) past 64 positions; 4 experts of intermediate 16, top-2,
        # router and expert biases, a swiglu limit small enough to clamp; tied embeddings (size).
        "gpt_oss": transformers.GptOssConfig(
            **{**small, "intermediate_size": 16},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            swiglu_limit=1.0,
            swiglu_alpha=1.5,
            attention_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": ORIGINAL_CONTEXT,
            },
            tie_word_embeddings=True,
        ),
        # Multi-head latent attention: q through q_lora_rank 24, a KV latent of 32 and a
        # rotary key of 8 (interleaved pairs), key parts of 16 and values of 12 per head (all
        # different, so a swapped size fails); yarn x4 past 64 positions with mscale_all_dim
        # 0.8 in the softmax scale. Layer 0 a dense MLP (of 32), layers 1-2 8 experts of 8 in 4
        # groups, top-2 of the 2 best groups by sigmoid scores steered by a random
        # e_score_correction_bias, renormalized times 2.5, and a shared expert.
        "deepseek_v3": transformers.DeepseekV3Config(
            **{**small, "num_key_value_heads": 4, "intermediate_size": 32},
            moe_intermediate_size=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_interleave=True,
            num_mtp_layers=0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL_CONTEXT,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            tie_word_embeddings=False,
        ),
    }


def check_llama3_bands(config: transformers.PretrainedConfig) -> None:
    """Fail unless the llama3 rope config exercises its unscaled, smooth and scaled branches."""
    rope, head_dim = config.rope_parameters, config.head_dim
    inv_freq = rope["rope_theta"] ** (-np.arange(0, head_dim, 2) / head_dim)  # f64[head_dim/2]
    wavelen = 2 * np.pi / inv_freq  # f64[head_dim/2]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    num_unscaled = int((wavelen < high_wavelen).sum())
    num_scaled = int((wavelen > low_wavelen).sum())
    num_smooth = len(wavelen) - num_unscaled - num_scaled
    if min(num_unscaled, num_smooth, num_scaled) == 0:
        raise RuntimeError(
            f"llama3 rope misses a branch: {wavelen=} {low_wavelen=} {high_wavelen=}"
        )


def randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Random weights, biases and RMSNorm scales (1 + 0.1 * randn) so logits are far from flat."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("sinks"):  # GPT-OSS: large enough to take a share of each row
                param.copy_(1.0 + noise)
            else:
                param.copy_(std * noise)
        # DeepSeek-V3's router bias is a buffer: random too, so it steers the choice.
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                noise = torch.randn(buffer.shape, generator=gen, dtype=torch.float32)
                buffer.copy_(0.1 * noise)


def greedy_run(
    model: torch.nn.Module, prompt_ids: list[int], num_steps: int
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy generation through transformers' KV cache: (ids, rows they came from, prefill)."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    prefill_logits = out.logits[0]  # f32[P, V]
    cache, row = out.cache, prefill_logits[-1]
    greedy_ids, rows = [], []
    for _ in range(num_steps):
        token = int(row.argmax())
        greedy_ids.append(token)
        rows.append(row)
        out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
        cache, row = out.cache, out.logits[0, -1]
    return greedy_ids, torch.stack(rows), prefill_logits


def golden(
    model: torch.nn.Module, prompt_ids: list[int], prompt2_ids: list[int], long: bool
) -> dict[str, np.ndarray]:
    """Eager fp32 reference outputs: prefill logits, a greedy loop and a second longer prefill."""
    with torch.no_grad():
        greedy_ids, decode_logits, prefill_logits = greedy_run(model, prompt_ids, NUM_GREEDY)
        # The cached loop must agree with one uncached forward over prompt + greedy tokens.
        full = model(torch.tensor([prompt_ids + greedy_ids[:-1]]), use_cache=False).logits[0]
        torch.testing.assert_close(full[len(prompt_ids) - 1 :], decode_logits, atol=1e-4, rtol=0)
        prefill2_logits = model(torch.tensor([prompt2_ids]), use_cache=False).logits[0]
        # NOTE: last, so dynamic rope's grown frequencies do not reach the runs above. Through
        # the cache each token is rotated by its own position, as jaxserve rotates it.
        if long:
            long_ids, long_logits, _ = greedy_run(model, prompt2_ids, NUM_LONG)
    top2 = decode_logits.topk(2, dim=-1).values  # f32[N, 2]
    extra = {}
    if long:
        long_top2 = long_logits.topk(2, dim=-1).values  # f32[NUM_LONG, 2]
        extra = {
            "long_greedy_ids": np.asarray(long_ids, np.int32),
            "long_decode_logits": long_logits.numpy().astype(np.float32),
            "long_greedy_margins": (long_top2[:, 0] - long_top2[:, 1]).numpy().astype(np.float32),
        }
    return extra | {
        "prompt_ids": np.asarray(prompt_ids, np.int32),
        "prefill_logits": prefill_logits.numpy().astype(np.float32),
        "greedy_ids": np.asarray(greedy_ids, np.int32),
        "decode_logits": decode_logits.numpy().astype(np.float32),
        "greedy_margins": (top2[:, 0] - top2[:, 1]).numpy().astype(np.float32),
        "prompt2_ids": np.asarray(prompt2_ids, np.int32),
        "prefill2_logits": prefill2_logits.numpy().astype(np.float32),
    }


def build_model(
    name: str,
    index: int,
    config: transformers.PretrainedConfig,
    tok: transformers.PreTrainedTokenizerFast,
    prompt_ids: list[int],
    prompt2_ids: list[int],
) -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    """First seed whose greedy steps all have a clear winner and emit no special token."""
    special_ids = set(tok.all_special_ids)
    for attempt in range(MAX_SEED_TRIES):
        seed = 1000 * (index + 1) + attempt
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        model = model.to(torch.float32).eval()
        randomize(model, seed, config.initializer_range)
        result = golden(model, prompt_ids, prompt2_ids, long=name in LONG_FIXTURES)
        long_margins = result.get("long_greedy_margins", np.ones(1))
        greedy = result["greedy_ids"].tolist() + result.get("long_greedy_ids", np.zeros(0)).tolist()
        if (
            result["greedy_margins"].min() > MIN_MARGIN
            and long_margins.min() > LONG_MIN_MARGIN
            and not special_ids & set(greedy)
        ):
            result["seed"] = np.int64(seed)
            return model, result
    raise RuntimeError(
        f"{name}: no seed in {MAX_SEED_TRIES} tries has greedy margins > {MIN_MARGIN}"
    )


def write_fixture(
    name: str,
    index: int,
    config: transformers.PretrainedConfig,
    tok: transformers.PreTrainedTokenizerFast,
    prompt_ids: list[int],
    prompt2_ids: list[int],
    chat_ids: list[int],
) -> None:
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    model, result = build_model(name, index, config, tok, prompt_ids, prompt2_ids)
    # NOTE: like an instruct checkpoint, generation stops on <|im_end|> as well as on the
    # config.json eos; the greedy golden tokens contain neither.
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=tok.pad_token_id,
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    result["chat_ids"] = np.asarray(chat_ids, np.int32)
    result["prompt_text"] = np.array(PROMPT)
    result["prompt2_text"] = np.array(PROMPT2)
    np.savez_compressed(out / "golden.npz", **result)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"{name:8s} seed={int(result['seed'])} greedy={result['greedy_ids'].tolist()} "
        f"min_margin={result['greedy_margins'].min():.3f} size={size / 1024:.0f} KiB"
    )


# Values of the published config.json files (Meta-Llama-3-8B, Qwen3-8B, gemma-2-9b, the text
# model of gemma-3-12b as a Gemma3ForCausalLM, Qwen3-30B-A3B, gpt-oss-20b and DeepSeek-V3), in
# their key spelling.
BUILTIN = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 16,
        "num_hidden_layers": 42,
        "num_key_value_heads": 8,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "sliding_window_size": 4096,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": 256000,
    },
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3840,
        "initializer_range": 0.02,
        "intermediate_size": 15360,
        "max_position_embeddings": 131072,
        "model_type": "gemma3_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 262208,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # openai/gpt-oss-20b as published, less its quantization_config (MXFP4 experts, which
    # jaxserve refuses): the shapes of its bf16 checkpoints.
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 201088,
    },
    # deepseek-ai/DeepSeek-V3 as published, less its quantization_config (fp8 block-scaled
    # weights) and auto_map (its own modeling code): the shapes of a bf16 checkpoint.
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "pretraining_tp": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 129280,
    },
}


def write_builtin_configs() -> None:
    for name, raw in BUILTIN.items():
        out = BUILTIN_CONFIGS / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        parsed = transformers.AutoConfig.from_pretrained(out)
        rope = parsed.rope_parameters.get("full_attention", parsed.rope_parameters)
        if rope["rope_theta"] != raw["rope_theta"]:
            raise RuntimeError(f"{name}: rope_theta={parsed.rope_parameters} was not parsed")


def main() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # BPE training must not depend on threads
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tok = build_tokenizer()
    prompt_ids = tok(PROMPT)["input_ids"]
    prompt2_ids = tok(PROMPT2)["input_ids"]
    chat_ids = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    print(f"vocab={len(tok)} prompt={len(prompt_ids)} prompt2={len(prompt2_ids)} tokens")
    if not 16 <= len(prompt_ids) <= 24 or not 49 <= len(prompt2_ids) <= 64:
        raise RuntimeError(f"{len(prompt_ids)=} {len(prompt2_ids)=} outside 16..24 / 49..64")
    configs = model_configs(tok)
    check_llama3_bands(configs["llama3"])
    only = sys.argv[1:]
    unknown = sorted(set(only) - set(configs))
    if unknown:
        raise SystemExit(f"unknown fixtures {unknown}; known: {', '.join(configs)}")
    for index, (name, config) in enumerate(configs.items()):
        if not only or name in only:
            write_fixture(name, index, config, tok, prompt_ids, prompt2_ids, chat_ids)
    write_builtin_configs()
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    print(
        f"fixtures total {total / 1024:.0f} KiB (torch {torch.__version__}, "
        f"transformers {transformers.__version__})"
    )


if __name__ == "__main__":
    main()
