"""Quantized weights against the unquantized model: logit error and greedy agreement.

Random prompts go through the model twice, with the model-dtype weights and with each
quantization (the same weights quantized on load, or the same random weights for
``--load-format dummy``); every prompt position is one greedy step (teacher-forced). Reported
per mode: the largest and mean absolute logit error, the largest relative to the largest
logit, and the share of positions whose argmax agrees: all of them, and those whose reference
top-2 margin is above ``--margin`` and above the median margin (random weights give near-ties).

    python -m benchmarks.quant_agreement                          # dummy Llama-3-8B (a GPU)
    python -m benchmarks.quant_agreement --model tests/fixtures/models/llama --load-format auto
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig, builtin_config_dir
from jaxserve.engine_config import EngineConfig
from jaxserve.models import decoder
from jaxserve.models.batch import Batch, make_kv_cache
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.layers import Weights
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.dummy import dummy_weights
from jaxserve.runner.devices import resolve_dtype, resolve_quantization
from jaxserve.units import cdiv

PAGE = 16


def prompt_batch(ids: np.ndarray) -> Batch:
    """One sequence, all of ``ids`` computed, pages 0.. in order."""
    n = len(ids)
    pos = np.arange(n, dtype=np.int32)
    pages = np.arange(cdiv(n, PAGE), dtype=np.int32)
    return Batch(
        input_ids=jnp.asarray(ids, jnp.int32),
        positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(pos),
        kv_lens=jnp.asarray([n], jnp.int32),
        page_indices=jnp.asarray(pages[None, :]),
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        logits_indices=jnp.asarray([n - 1], jnp.int32),
    )


def all_logits(weights: Weights, config: ModelConfig, prompts: np.ndarray, dtype) -> list:
    forward = jax.jit(decoder.forward, static_argnums=(3,))
    pages = cdiv(prompts.shape[1], PAGE)
    out = []
    for ids in prompts:
        cache = make_kv_cache(
            config.num_layers, pages, PAGE, config.num_kv_heads, config.head_dim, dtype
        )
        _, hidden = forward(weights, cache, prompt_batch(ids), config)
        logits = decoder.compute_logits(weights, hidden, config.final_logit_softcap)
        out.append(np.asarray(logits, np.float32))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    parser.add_argument("--quantizations", default="fp8,int8")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--margin", type=float, default=0.5, help="top-2 margin threshold")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    config = load_model_config(args.model)
    base = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype)
    dtype = resolve_dtype(base)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, size=(args.num_prompts, args.prompt_len))

    def weights_for(engine: EngineConfig) -> Weights:
        scheme = resolve_quantization(engine)
        if args.load_format == "dummy":
            return dummy_weights(config, dtype, seed=0, scheme=scheme)
        return load_weights(args.model, config, dtype, scheme=scheme)

    reference = all_logits(weights_for(base), config, prompts, dtype)
    ref = np.concatenate(reference)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    results = {}
    for quantization in args.quantizations.split(","):
        engine = EngineConfig(
            model=args.model, load_format=args.load_format, dtype=args.dtype,
            quantization=quantization,
        )  # fmt: skip
        got = np.concatenate(all_logits(weights_for(engine), config, prompts, dtype))
        error = np.abs(got - ref)
        agree = got.argmax(-1) == ref.argmax(-1)
        above = margins > args.margin
        above_median = margins > np.median(margins)
        results[quantization] = row = {
            "max_abs_error": float(error.max()),
            "mean_abs_error": float(error.mean()),
            "max_error_over_max_logit": float(error.max() / np.abs(ref).max()),
            "agreement": float(agree.mean()),
            f"agreement_margin_above_{args.margin}": float(agree[above].mean())
            if above.any()
            else None,
            "positions_margin_above": int(above.sum()),
            "agreement_margin_above_median": float(agree[above_median].mean()),
            "median_margin": float(np.median(margins)),
        }
        print(quantization, json.dumps(row), flush=True)
    if args.output_json:
        meta = {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "model": args.model,
            "load_format": args.load_format,
            "positions": int(ref.shape[0]),
            "logit_std": float(ref.std()),
        }
        Path(args.output_json).write_text(json.dumps({"meta": meta, **results}, indent=2))


if __name__ == "__main__":
    main()
