"""Pre-quantized Hugging Face checkpoints (fp8, fp8 blocks, compressed-tensors, AWQ, GPTQ),
made from the fixture models by scripts/make_quantized.py in the published layouts, read back
and checked against a dequantization written here independently, bit by bit."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import jaxserve
from jaxserve import SamplingParams
from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
from jaxserve.config import ModelConfig
from jaxserve.models import decoder
from jaxserve.models.batch import make_kv_cache
from jaxserve.models.families.fields import HF_LAYER_PREFIX
from jaxserve.models.families.registry import layer_fields, load_model_config
from jaxserve.models.layers import Weights
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.checkpoint_reader import WeightsError
from jaxserve.models.loading.quant_checkpoint import read_fp8
from jaxserve.models.quant import QUANTIZED_FIELDS, QArray, dequantize
from jaxserve.models.quant_scheme import resolve_scheme
from tests.conftest import fixture_dir
from tests.test_model_parity import PAGE, one_sequence_batch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_quantized", ROOT / "scripts/make_quantized.py")
assert _spec is not None and _spec.loader is not None
make_quantized_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_quantized_module)
make_quantized = make_quantized_module.make_quantized

GROUP, BLOCK = 32, 32  # the fixtures' dims (64, 96; 32 KV rows) are multiples of both
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble n holds column AWQ_ORDER[n] of 8


def nibbles(word: np.ndarray, n: int) -> np.ndarray:
    return ((word.view(np.uint32) >> np.uint32(4 * n)) & np.uint32(15)).astype(np.float32)


def reference_weight(t: dict[str, np.ndarray], base: str, qc: dict) -> np.ndarray:
    """f32 [out, in] of one quantized Linear, straight from the published layout."""
    method = qc["quant_method"]
    if method in ("fp8", "compressed-tensors"):
        w = t[f"{base}.weight"].astype(np.float32)
        if "weight_block_size" in qc:
            bo, bi = qc["weight_block_size"]
            s = t[f"{base}.weight_scale_inv"]
            return w * np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)
        s = t[f"{base}.weight_scale"].astype(np.float32)
        return w * (s.reshape(-1, 1) if s.size > 1 else s.reshape(()))
    group = qc["group_size"]
    if method == "awq":
        qw, qz = t[f"{base}.qweight"], t[f"{base}.qzeros"]  # [in, out/8], [G, out/8]
        q = np.zeros((qw.shape[0], qw.shape[1] * 8), np.float32)
        z = np.zeros((qz.shape[0], qz.shape[1] * 8), np.float32)
        for n, column in enumerate(AWQ_ORDER):
            q[:, column::8] = nibbles(qw, n)
            z[:, column::8] = nibbles(qz, n)
        g_idx = np.arange(q.shape[0]) // group
    else:
        qw, qz = t[f"{base}.qweight"], t[f"{base}.qzeros"]  # [in/8, out], [G, out/8]
        q = np.zeros((qw.shape[0] * 8, qw.shape[1]), np.float32)
        z = np.zeros((qz.shape[0], qz.shape[1] * 8), np.float32)
        for n in range(8):
            q[n::8] = nibbles(qw, n)
            z[:, n::8] = nibbles(qz, n) + 1  # v1 checkpoints store zero points minus one
        g_idx = t[f"{base}.g_idx"]
    s = t[f"{base}.scales"].astype(np.float32)  # [G, out]
    return ((q - z[g_idx]) * s[g_idx]).T


def read_all(model_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    with safe_open(model_dir / "model.safetensors", framework="numpy") as f:
        for name in f.keys():
            if f.get_slice(name).get_dtype() == "F8_E4M3":
                out[name] = np.asarray(read_fp8(model_dir / "model.safetensors", name))
            else:
                out[name] = f.get_tensor(name)
    return out


def logits(model_dir: Path, weights: Weights, config: ModelConfig) -> np.ndarray:
    ids = np.load(fixture_dir("llama") / "golden.npz")["prompt2_ids"].tolist()
    cache = make_kv_cache(
        config.num_layers, 16, PAGE, config.num_kv_heads, config.head_dim, jnp.float32
    )
    batch = one_sequence_batch(ids, 0, list(range(14)), 16 * PAGE)
    _, hidden = jax.jit(decoder.forward, static_argnums=(3,))(weights, cache, batch, config)
    return np.asarray(decoder.compute_logits(weights, hidden, config.final_logit_softcap))


FORMATS = [
    ("llama", "fp8"),
    ("llama", "fp8-block"),
    ("llama", "compressed-tensors"),
    ("llama", "awq"),
    ("llama", "gptq"),
    ("phi3", "awq"),  # fused qkv_proj and gate_up_proj, split after loading
]


@pytest.mark.parametrize(("family", "fmt"), FORMATS)
def test_checkpoint_loads_to_its_dequantized_reference(tmp_path, family: str, fmt: str) -> None:
    """Every quantized weight equals the reference dequantization of the published tensors,
    and the model on the packed weights computes the logits of the dense reference model."""
    model_dir = make_quantized(fixture_dir(family), tmp_path / fmt, fmt, GROUP, BLOCK)
    qc = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    config = load_model_config(model_dir)
    scheme = resolve_scheme(None, model_dir)
    assert scheme is not None and scheme.method == qc["quant_method"]
    weights = load_weights(model_dir, config, jnp.float32, scheme=scheme)
    dense = load_weights(fixture_dir(family), config, jnp.float32)
    tensors = read_all(model_dir)
    for layer, (lw, dense_lw) in enumerate(zip(weights.layers, dense.layers, strict=True)):
        prefix = HF_LAYER_PREFIX.format(layer=layer)
        for field in layer_fields(config):
            if field.name not in QUANTIZED_FIELDS:
                continue
            w = getattr(lw, field.name)
            assert isinstance(w, QArray)
            full = reference_weight(tensors, prefix + field.hf_name.removesuffix(".weight"), qc)
            expected = full[field.part_rows(config)]  # a fused tensor's part
            np.testing.assert_allclose(np.asarray(dequantize(w, jnp.float32)), expected, atol=1e-6)
            setattr(dense_lw, field.name, jnp.asarray(field.from_hf(full, config)))
    got = logits(model_dir, weights, config)
    np.testing.assert_allclose(got, logits(model_dir, dense, config), atol=2e-4, rtol=2e-4)
    # The embedding and lm_head are the checkpoint's own, unquantized.
    assert not isinstance(weights.embed, QArray) and not isinstance(weights.lm_head, QArray)


def test_hand_packed_awq_and_gptq_words(tmp_path) -> None:
    """One word of each layout written by hand: AWQ's interleaved columns, GPTQ's rows."""
    from jaxserve.models.loading.quant_checkpoint import AWQ_PACK_ORDER, pack_np, unpack_np

    values = np.arange(8, dtype=np.uint8) + 3  # columns 0..7 hold 3..10
    awq_word = sum(int(values[AWQ_PACK_ORDER[n]]) << (4 * n) for n in range(8))
    gptq_word = sum(int(values[n]) << (4 * n) for n in range(8))
    awq = np.array([[awq_word]], np.uint32).view(np.int32)
    gptq = np.array([[gptq_word]], np.uint32).view(np.int32)
    np.testing.assert_array_equal(unpack_np(awq, AWQ_PACK_ORDER)[0], values)
    np.testing.assert_array_equal(unpack_np(gptq)[0], values)
    np.testing.assert_array_equal(pack_np(values[None], AWQ_PACK_ORDER), awq)
    # The top nibble sets the sign bit of the int32: still 0..15 after unpacking.
    top = np.array([[0xF0000000]], np.uint32).view(np.int32)
    assert unpack_np(top)[0, 7] == 15


def test_misshapen_scale_names_the_tensor(tmp_path) -> None:
    model_dir = make_quantized(fixture_dir("llama"), tmp_path / "ct", "compressed-tensors")
    tensors = read_all(model_dir)
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = np.ones((3, 1), np.float32)
    make_quantized_module.write_safetensors(model_dir / "model.safetensors", tensors)
    config = load_model_config(model_dir)
    with pytest.raises(WeightsError, match=f"{name}.*shape \\[3, 1\\]"):
        load_weights(model_dir, config, jnp.float32, scheme=resolve_scheme(None, model_dir))


def test_llm_serves_a_gptq_checkpoint_detected_from_its_config(tmp_path, capsys) -> None:
    model_dir = make_quantized(fixture_dir("llama"), tmp_path / "gptq", "gptq", GROUP)
    llm = jaxserve.LLM(
        str(model_dir),
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        block_size=4,
        num_gpu_blocks_override=32,
        dtype="float32",
        warmup=False,
    )
    runner = llm.engine.runner
    assert runner.quant is not None and runner.quant.method == "gptq"
    assert isinstance(runner.weights.layers[0].w_down, QArray)
    # Capacity planning (and `jaxserve capacity`, from config.json alone) counts what the
    # device holds: packed values, scales, zero points and g_idx.
    on_device = sum(x.nbytes for x in jax.tree.leaves(runner.weights))
    assert runner.capacity.weight_bytes == on_device
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    args = parser.parse_args([str(model_dir), "--dtype", "float32", "--device-memory", "1GiB"])
    args.json = True
    assert run_capacity(args) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == on_device
    config = load_model_config(model_dir)
    golden = np.load(fixture_dir("llama") / "golden.npz")
    ids = golden["prompt_ids"].tolist()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    # The engine's first token is the argmax of the model's own last-row logits.
    cache = make_kv_cache(
        config.num_layers, 16, PAGE, config.num_kv_heads, config.head_dim, jnp.float32
    )
    batch = one_sequence_batch(ids, 0, list(range(6)), 16 * PAGE)
    _, hidden = jax.jit(decoder.forward, static_argnums=(3,))(runner.weights, cache, batch, config)
    last = np.asarray(decoder.compute_logits(runner.weights, hidden))[-1]
    assert out[0].outputs[0].token_ids == [int(last.argmax())]
