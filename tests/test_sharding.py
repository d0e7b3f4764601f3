"""Tensor parallelism: TP=1 == TP=2 == TP=4 (== TP=8 where the heads allow), sharded weights,
the compiled step's collectives, and a two-process ``jax.distributed`` run on loopback.

The multi-device checks need 8 host devices, which jax fixes when its backend starts, so they
run in one subprocess (this file run as a script with ``XLA_FLAGS`` set) that prints its
measurements as JSON; the two-process run starts this file twice more. The tests assert here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.models.families.registry import load_model_config
from jaxserve.runner.parallel.distributed import (
    ENV_COORDINATOR_ADDRESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    DistributedConfig,
    broadcast_step_inputs,
    initialize_distributed,
)
from jaxserve.runner.parallel.sharding import make_mesh, validate_tensor_parallel_size

FIXTURES = Path(__file__).parent / "fixtures" / "models"
PAGE_SIZE = 4
NUM_PAGES = 40
PAGES_PER_SEQ = 16
NUM_TOKENS = 128  # one padded shape for prefill and decode: one compile per model and degree
NUM_DECODE_STEPS = 4
COLLECTIVE = re.compile(
    r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


# -- the script side (runs in the subprocesses) --------------------------------------------------


def _batch(items, tables, num_tokens=NUM_TOKENS):
    """A padded host ``Batch``: items are (new token ids, start position) per sequence."""
    from jaxserve.models.batch import Batch

    num_seqs = len(tables)
    num_slots = NUM_PAGES * PAGE_SIZE
    input_ids = np.zeros(num_tokens, np.int32)  # i32[T]
    positions = np.zeros(num_tokens, np.int32)  # i32[T]
    slot_mapping = np.full(num_tokens, num_slots, np.int32)  # i32[T]
    kv_lens = np.zeros(num_seqs, np.int32)  # i32[S]
    page_indices = np.zeros((num_seqs, PAGES_PER_SEQ), np.int32)  # i32[S, pages_per_seq]
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)  # i32[S + 1]
    logits_indices = np.zeros(num_seqs, np.int32)  # i32[S]
    offset = 0
    for i, ((ids, start), table) in enumerate(zip(items, tables, strict=True)):
        n = len(ids)
        pos = np.arange(start, start + n)
        input_ids[offset : offset + n] = ids
        positions[offset : offset + n] = pos
        slot_mapping[offset : offset + n] = table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        kv_lens[i] = start + n
        page_indices[i, : len(table)] = table
        offset += n
        cu_q_lens[i + 1] = offset
        logits_indices[i] = offset - 1
    return Batch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        kv_lens=kv_lens,
        page_indices=page_indices,
        cu_q_lens=cu_q_lens,
        num_seqs=np.array([num_seqs], np.int32),
        logits_indices=logits_indices,
    )


def _page_tables(lengths):
    """Disjoint, shuffled pages for each sequence."""
    perm = np.random.default_rng(0).permutation(NUM_PAGES).astype(np.int32)
    tables, used = [], 0
    for length in lengths:
        n = -(-length // PAGE_SIZE)
        tables.append(perm[used : used + n])
        used += n
    return tables


def _step(weights, kv_cache, batch, *, config, attention_fn):
    from jaxserve.models import decoder

    kv_cache, hidden = decoder.forward(weights, kv_cache, batch, config, attention_fn)
    return kv_cache, decoder.compute_logits(weights, hidden[batch.logits_indices])  # f32[S, V]


def _shard_summary(array):
    """Per-device shard shapes and index, in device order."""
    shards = sorted(array.addressable_shards, key=lambda s: s.device.id)
    return [
        {
            "shape": list(s.data.shape),
            "index": [[sl.start, sl.stop] for sl in s.index if isinstance(sl, slice)],
        }
        for s in shards
    ]


def _generate(config, weights_of, tp_size, prompts):
    """Greedy: one prefill of all prompts, then NUM_DECODE_STEPS decode steps.

    Returns token ids [S, steps + 1], logits f32[steps + 1, S, V], the compiled step's
    collectives and, when sharded, the shard layout.
    """
    import jax
    import jax.numpy as jnp

    from jaxserve.models.batch import make_kv_cache
    from jaxserve.runner.parallel.sharding import prepare_tp

    lengths = [len(p) + NUM_DECODE_STEPS + 1 for p in prompts]
    tables = _page_tables(lengths)
    report = {}
    if tp_size is None:  # the plain single-device program, no mesh at all
        weights = weights_of(None)
        cache = make_kv_cache(
            config.num_layers, NUM_PAGES, PAGE_SIZE, config.num_kv_heads, config.head_dim,
            jnp.float32,
        )  # fmt: skip
        step = jax.jit(
            functools.partial(_step, config=config, attention_fn=None),
            donate_argnames=("kv_cache",),
        )
        put = jax.device_put
    else:
        tp = prepare_tp(config, tp_size, devices=jax.devices()[:tp_size])
        weights = weights_of(tp.placement)
        cache = tp.make_kv_cache(NUM_PAGES, PAGE_SIZE, jnp.float32)
        in_shardings, out_shardings = tp.step_shardings()
        in_shardings = in_shardings[:3]  # this step takes an unpacked batch, no previous ids
        step = jax.jit(
            functools.partial(_step, config=config, attention_fn=tp.attention_fn),
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnames=("kv_cache",),
        )
        put = tp.put_replicated
        layer = weights.layers[0]
        report["shards"] = {
            name: _shard_summary(array)
            for name, array in {
                "wq": layer.wq,
                "wk": layer.wk,
                "wo": layer.wo,
                "w_gate": layer.w_gate,
                "w_down": layer.w_down,
                "attn_norm": layer.attn_norm,
                "embed": weights.embed,
                "k_pages": cache[0][0],
            }.items()
        }
    items = [(np.asarray(p, np.int32), 0) for p in prompts]
    tokens, logits, compiled = [], [], None
    for _ in range(NUM_DECODE_STEPS + 1):
        batch = put(_batch(items, tables))
        if compiled is None:  # ahead of time, as the runner's warm-up does
            compiled = step.lower(weights, cache, batch).compile()
            report["collectives"] = [list(m) for m in COLLECTIVE.findall(compiled.as_text())]
        cache, out = compiled(weights, cache, batch)
        out = np.asarray(out)  # f32[S, V]
        logits.append(out)
        next_ids = out.argmax(-1)
        tokens.append(next_ids)
        items = [
            (np.array([t], np.int32), start + len(ids))
            for t, (ids, start) in zip(next_ids, items, strict=True)
        ]
    report["tokens"] = np.stack(tokens, 1).tolist()
    report["logits"] = np.stack(logits)
    return report


def _fixture_weights(model_dir, config):
    import jax.numpy as jnp

    from jaxserve.models.loading.checkpoint_loader import load_weights

    return lambda placement: load_weights(model_dir, config, jnp.float32, placement=placement)


def _check_tensor_parallel() -> dict:
    """Every measurement the TP tests assert on: llama, qwen3, qwen2 and an 8-query-head llama."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models.loading.dummy import dummy_weights

    assert jax.device_count() == 8, jax.devices()
    results: dict = {}
    # qwen2 adds q/k/v biases (split with their heads); TP=4 > 2 KV heads replicates them.
    for family, degrees in (("llama", (1, 2, 4)), ("qwen3", (1, 2, 4)), ("qwen2", (2, 4))):
        model_dir = FIXTURES / family
        config = load_model_config(model_dir)
        golden = np.load(model_dir / "golden.npz")
        prompts = [golden["prompt_ids"].tolist(), golden["prompt2_ids"].tolist()]
        weights_of = _fixture_weights(model_dir, config)
        base = _generate(config, weights_of, None, prompts)
        entry = {
            "golden_tokens": golden["greedy_ids"][: NUM_DECODE_STEPS + 1].tolist(),
            "golden_logits_err": float(
                max(
                    np.abs(
                        base["logits"][:, 0] - golden["decode_logits"][: len(base["logits"])]
                    ).max(),
                    np.abs(base["logits"][0, 1] - golden["prefill2_logits"][-1]).max(),
                )
            ),
            "tokens": {"plain": base["tokens"]},
            "logits_err": {},
        }
        for n in degrees:
            run = _generate(config, weights_of, n, prompts)
            entry["tokens"][n] = run["tokens"]
            entry["logits_err"][n] = float(np.abs(run["logits"] - base["logits"]).max())
            entry.setdefault("shards", {})[n] = run["shards"]
            entry.setdefault("collectives", {})[n] = run["collectives"]
        results[family] = entry

    results["write_kv"] = _check_sharded_write_kv()
    results["fp8_attention"] = _check_sharded_fp8_attention()

    # 8 query heads over 2 KV heads: TP=8 replicates each KV head on 4 devices.
    llama = load_model_config(FIXTURES / "llama")
    wide = dataclasses.replace(llama, num_q_heads=8, head_dim=8)

    def wide_weights(placement):
        return dummy_weights(wide, jnp.float32, seed=1, placement=placement, scale=0.3)

    prompts = [list(range(5, 25)), list(range(40, 47))]
    base = _generate(wide, wide_weights, None, prompts)
    run = _generate(wide, wide_weights, 8, prompts)
    results["wide"] = {
        "tokens": {"plain": base["tokens"], 8: run["tokens"]},
        "logits_err": {8: float(np.abs(run["logits"] - base["logits"]).max())},
        "shards": {8: run["shards"]},
        "collectives": {8: run["collectives"]},
    }
    return results


def _check_sharded_write_kv() -> dict:
    """The shard_map'd KV write at TP=4 (2 KV heads, each on 2 devices) == the plain scatter."""
    import jax
    import jax.numpy as jnp

    from jaxserve.runner.parallel.sharding import prepare_tp, sharded_write_kv
    from pallas_kernels import kv_cache

    config = load_model_config(FIXTURES / "llama")
    tp = prepare_tp(config, 4, devices=jax.devices()[:4])
    k_pages, v_pages = tp.make_kv_cache(NUM_PAGES, PAGE_SIZE, jnp.float32)[0]
    rng = np.random.default_rng(0)
    shape = (NUM_TOKENS, config.num_kv_heads, config.head_dim)
    k = rng.standard_normal(shape, np.float32)  # f32[T, K, D]
    v = rng.standard_normal(shape, np.float32)
    slots = rng.permutation(NUM_PAGES * PAGE_SIZE + 8)[:NUM_TOKENS].astype(np.int32)  # some drop
    write = jax.jit(sharded_write_kv(kv_cache.write_kv, tp.mesh, config))
    hlo = write.lower(k_pages, v_pages, k, v, slots).compile().as_text()
    got = write(k_pages, v_pages, k, v, slots)
    zeros = jnp.zeros((NUM_PAGES, PAGE_SIZE, config.num_kv_heads, config.head_dim), jnp.float32)
    want = kv_cache.write_kv(zeros, zeros, k, v, slots)
    return {
        "err": max(
            float(np.abs(np.asarray(g) - np.asarray(w)).max())
            for g, w in zip(got, want, strict=True)
        ),
        "collectives": [list(m) for m in COLLECTIVE.findall(hlo)],
        "sharding_kept": all(g.sharding.is_equivalent_to(tp.kv_sharding, 4) for g in got),
    }


def _check_sharded_fp8_attention() -> dict:
    """An fp8 cache and its scales through the shard_map'd attention at TP=2 == the reference."""
    import jax
    import jax.numpy as jnp

    from jaxserve.runner.parallel.sharding import prepare_tp
    from pallas_kernels import kv_cache
    from pallas_kernels.ragged_paged_attention import reference

    config = load_model_config(FIXTURES / "llama")
    tp = prepare_tp(config, 2, devices=jax.devices()[:2])
    rng = np.random.default_rng(3)
    kv_shape = (NUM_PAGES, PAGE_SIZE, config.num_kv_heads, config.head_dim)
    k_pages, v_pages = (
        jax.device_put(
            kv_cache.quantize_kv(jnp.asarray(rng.standard_normal(kv_shape)), jnp.float8_e4m3fn, s),
            tp.kv_sharding,
        )
        for s in (0.01, 0.02)
    )
    q = jnp.asarray(rng.standard_normal((6, config.num_q_heads, config.head_dim)), jnp.float32)
    metadata = (
        jnp.asarray([7, 13], jnp.int32),  # kv_lens
        jnp.asarray(rng.permutation(NUM_PAGES)[:8].reshape(2, 4), jnp.int32),  # page_indices
        jnp.asarray([0, 2, 6], jnp.int32),  # cu_q_lens
        jnp.asarray([2], jnp.int32),  # num_seqs
    )

    def attention(fn, *args, k_scale, v_scale):
        return fn(*args, sm_scale=0.25, k_scale=k_scale, v_scale=v_scale)

    got = jax.jit(functools.partial(attention, tp.attention_fn))(
        q, k_pages, v_pages, *metadata, k_scale=0.01, v_scale=0.02
    )
    want = attention(
        reference.ragged_paged_attention,
        q,
        k_pages,
        v_pages,
        *metadata,
        k_scale=0.01,
        v_scale=0.02,
    )
    return {
        "err": float(np.abs(np.asarray(got) - np.asarray(want)).max()),
        "scale": float(np.abs(np.asarray(want)).max()),
    }


def _check_two_processes(port: int, process_id: int) -> dict | None:
    """TP=2 over two processes, process 0 scheduling and broadcasting every step's inputs."""
    from jaxserve.runner.parallel.distributed import (
        broadcast_ints,
        broadcast_step_inputs,
        initialize_distributed,
        is_coordinator,
    )

    initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    import jax
    import jax.numpy as jnp

    from jaxserve.runner.parallel.sharding import prepare_tp

    model_dir = FIXTURES / "llama"
    config = load_model_config(model_dir)
    tp = prepare_tp(config, 2)
    weights = _fixture_weights(model_dir, config)(tp.placement)
    cache = tp.make_kv_cache(NUM_PAGES, PAGE_SIZE, jnp.float32)
    in_shardings, out_shardings = tp.step_shardings()
    in_shardings = in_shardings[:3]  # this step takes an unpacked batch, no previous ids
    step = jax.jit(
        functools.partial(_step, config=config, attention_fn=tp.attention_fn),
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        donate_argnames=("kv_cache",),
    )
    golden = np.load(model_dir / "golden.npz")
    prompt = golden["prompt_ids"]
    tables = _page_tables([len(prompt) + NUM_DECODE_STEPS + 1])
    item = (prompt.astype(np.int32), 0)
    tokens, logits = [], []
    while True:
        # The header: how many tokens this step has (0 = stop). Followers learn shapes from it.
        num_new = len(item[0]) if len(tokens) <= NUM_DECODE_STEPS else 0
        header = [num_new] if is_coordinator() else None
        (num_new,) = broadcast_ints(header, 1)
        if num_new == 0:
            break
        if is_coordinator():
            host = _batch([item], tables)
        else:  # a placeholder of the same shapes; its values are overwritten
            host = _batch([(np.zeros(num_new, np.int32), 0)], [np.zeros(PAGES_PER_SEQ, np.int32)])
        host = broadcast_step_inputs(host)
        cache, out = step(weights, cache, tp.put_replicated(host))
        out = np.asarray(out)[0]  # f32[V]
        token = int(out.argmax())
        tokens.append(token)
        logits.append(out)
        item = (np.array([token], np.int32), item[1] + len(item[0]))
    if not is_coordinator():
        return None
    return {
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "tokens": tokens,
        "logits_err": float(
            np.abs(np.stack(logits) - golden["decode_logits"][: len(logits)]).max()
        ),
        "golden_tokens": golden["greedy_ids"][: len(tokens)].tolist(),
    }


# -- the test side -------------------------------------------------------------------------------


def _script_env(num_devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    for name in (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def tp_results() -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "tp"],
        env=_script_env(8),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_tp_matches_single_device_and_golden(tp_results, family):
    entry = tp_results[family]
    assert entry["golden_logits_err"] < 2e-4
    assert entry["tokens"]["plain"][0] == entry["golden_tokens"]
    assert entry["tokens"].keys() - {"plain"} >= {"2", "4"}
    for n in entry["tokens"].keys() - {"plain"}:
        assert entry["tokens"][n] == entry["tokens"]["plain"], f"TP={n}"
        assert entry["logits_err"][n] < 1e-4, f"TP={n}: {entry['logits_err'][n]}"


def test_tp8_replicates_each_kv_head_on_four_devices(tp_results):
    wide = tp_results["wide"]
    assert wide["tokens"]["8"] == wide["tokens"]["plain"]
    assert wide["logits_err"]["8"] < 1e-4
    shards = wide["shards"]["8"]
    assert [s["shape"] for s in shards["wq"]] == [[64, 1, 8]] * 8
    assert [s["index"][1] for s in shards["wk"]] == [[0, 1]] * 4 + [[1, 2]] * 4
    assert [s["index"][2] for s in shards["k_pages"]] == [[0, 1]] * 4 + [[1, 2]] * 4


def test_weights_and_cache_are_really_sharded(tp_results):
    # llama fixture: H 64, 4 q heads, 2 KV heads, D 16, I 96, V 320; cache [40, 4, 2, 16].
    expected = {
        "1": {"wq": [64, 4, 16], "wk": [64, 2, 16], "wo": [4, 16, 64], "w_gate": [64, 96],
              "w_down": [96, 64], "embed": [320, 64], "k_pages": [40, 4, 2, 16]},
        "2": {"wq": [64, 2, 16], "wk": [64, 1, 16], "wo": [2, 16, 64], "w_gate": [64, 48],
              "w_down": [48, 64], "embed": [160, 64], "k_pages": [40, 4, 1, 16]},
        "4": {"wq": [64, 1, 16], "wk": [64, 1, 16], "wo": [1, 16, 64], "w_gate": [64, 24],
              "w_down": [24, 64], "embed": [80, 64], "k_pages": [40, 4, 1, 16]},
    }  # fmt: skip
    for n, shapes in expected.items():
        shards = tp_results["llama"]["shards"][n]
        for name, shape in shapes.items():
            assert [s["shape"] for s in shards[name]] == [shape] * int(n), (n, name)
        assert [s["shape"] for s in shards["attn_norm"]] == [[64]] * int(n)
    # TP=4 > 2 KV heads: devices 0-1 hold KV head 0, devices 2-3 KV head 1.
    four = tp_results["llama"]["shards"]["4"]
    assert [s["index"][1] for s in four["wk"]] == [[0, 1], [0, 1], [1, 2], [1, 2]]
    assert [s["index"][1] for s in four["wq"]] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    # qwen3 ties the embedding: the shared table is vocab-parallel.
    assert [s["shape"] for s in tp_results["qwen3"]["shards"]["4"]["embed"]] == [[80, 64]] * 4


@pytest.mark.parametrize(
    ("family", "degree"),
    [("llama", "2"), ("llama", "4"), ("qwen3", "4"), ("qwen2", "4"), ("wide", "8")],
)
def test_compiled_step_has_only_all_reduces_and_the_logits_gather(tp_results, family, degree):
    # 2 layers, T=128 padded tokens, H=64, S=2 sequences, V=320. One all-reduce of the [T, H]
    # activations for the vocab-parallel embedding lookup and one after each row-parallel
    # projection (wo, w_down); one all-gather of the vocab-parallel logits. Nothing else: the
    # KV-cache writes and the attention stay on each device.
    found = tp_results[family]["collectives"][degree]
    collectives = [(shape.split("{")[0], kind) for shape, kind in found]
    assert sorted(collectives) == sorted(
        [("f32[128,64]", "all-reduce")] * (1 + 2 * 2) + [("f32[2,320]", "all-gather")]
    ), found


def test_single_device_step_has_no_collectives(tp_results):
    assert tp_results["llama"]["collectives"]["1"] == []


def test_sharded_kv_write_stays_local(tp_results):
    result = tp_results["write_kv"]
    assert result["err"] == 0.0
    assert result["collectives"] == []
    assert result["sharding_kept"]


def test_sharded_attention_reads_an_fp8_cache_with_its_scales(tp_results):
    result = tp_results["fp8_attention"]
    assert result["err"] < 1e-5 and result["scale"] > 1e-2


def test_two_process_distributed_matches_one_process():
    from tests.conftest import free_port, wait_for_all  # this file also runs as a script

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "dist", str(port), str(pid)],
            env=_script_env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    wait_for_all(procs, 180)
    outputs = [proc.communicate() for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-4000:]
    result = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert (result["devices"], result["processes"]) == (2, 2)
    assert result["tokens"] == result["golden_tokens"]
    assert result["logits_err"] < 2e-4


def test_tp_degree_errors_name_the_value():
    llama = load_model_config(FIXTURES / "llama")  # 4 q heads, 2 KV heads, I 96
    with pytest.raises(ValueError, match="tensor_parallel_size=8 must divide num_q_heads=4"):
        validate_tensor_parallel_size(llama, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_q_heads=4"):
        validate_tensor_parallel_size(llama, 3)
    six = dataclasses.replace(llama, num_q_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match="exceeds num_kv_heads=2 and must then be a multiple"):
        validate_tensor_parallel_size(six, 3)
    wide_kv = dataclasses.replace(llama, num_q_heads=12, num_kv_heads=6)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide num_kv_heads=6"):
        validate_tensor_parallel_size(wide_kv, 4)
    odd_mlp = dataclasses.replace(llama, intermediate_size=90)
    with pytest.raises(ValueError, match="must divide intermediate_size=90"):
        validate_tensor_parallel_size(odd_mlp, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be a positive integer"):
        make_mesh(0)
    import jax

    too_many = jax.device_count() + 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size={too_many} exceeds the"):
        make_mesh(too_many)


def test_weight_specs_follow_the_config():
    from jax.sharding import PartitionSpec as P

    from jaxserve.runner.parallel.sharding import weight_specs

    llama = load_model_config(FIXTURES / "llama")  # V 320, untied, no biases
    specs = weight_specs(llama, 4)
    assert (specs.embed, specs.lm_head) == (P("tp", None), P(None, "tp"))
    assert specs.layers[0].bq is None and specs.layers[0].q_norm is None
    # A vocabulary the degree does not divide stays whole on every device.
    odd_vocab = weight_specs(dataclasses.replace(llama, vocab_size=321), 4)
    assert (odd_vocab.embed, odd_vocab.lm_head) == (P(None, None), P(None, None))
    qwen2 = weight_specs(load_model_config(FIXTURES / "qwen2"), 2)  # biases, tied
    assert (qwen2.layers[0].bq, qwen2.layers[0].bk) == (P("tp", None), P("kv", None))
    assert qwen2.lm_head is None


def test_distributed_config_from_flags_and_env():
    env = {ENV_COORDINATOR_ADDRESS: "10.0.0.1:1234", ENV_NUM_PROCESSES: "4", ENV_PROCESS_ID: "3"}
    assert DistributedConfig.resolve(env=env) == DistributedConfig("10.0.0.1:1234", 4, 3)
    # Flags win over the environment.
    assert DistributedConfig.resolve("h:1", 2, 0, env=env) == DistributedConfig("h:1", 2, 0)
    assert DistributedConfig.resolve(env={}) == DistributedConfig()
    assert DistributedConfig.resolve(env={ENV_COORDINATOR_ADDRESS: "auto"}).is_multi_process
    # Nothing set: a single process, and initialising is a no-op.
    assert initialize_distributed(env={}) == DistributedConfig()
    with pytest.raises(ValueError, match=r"process_id=4 must be in \[0, num_processes=4\)"):
        DistributedConfig.resolve(env=env | {ENV_PROCESS_ID: "4"})
    with pytest.raises(ValueError, match=r"\$JAXSERVE_NUM_PROCESSES='two' must be an integer"):
        DistributedConfig.resolve(env=env | {ENV_NUM_PROCESSES: "two"})
    with pytest.raises(ValueError, match="coordinator_address='nohost' must be 'host:port'"):
        DistributedConfig.resolve(env=env | {ENV_COORDINATOR_ADDRESS: "nohost"})
    with pytest.raises(ValueError, match="num_processes=2 needs a coordinator_address"):
        DistributedConfig(num_processes=2, process_id=1)


def test_broadcast_is_identity_with_one_process():
    tree = {"ids": np.arange(4, dtype=np.int32), "mask": np.array([True, False])}
    out = broadcast_step_inputs(tree)
    assert out["ids"].tolist() == [0, 1, 2, 3] and out["mask"].dtype == np.bool_


if __name__ == "__main__":
    if sys.argv[1] == "tp":
        print(json.dumps(_check_tensor_parallel()))
    elif sys.argv[1] == "dist":
        result = _check_two_processes(int(sys.argv[2]), int(sys.argv[3]))
        if result is not None:
            print(json.dumps(result))
