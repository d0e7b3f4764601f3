"""LoRA adapters against transformers + peft: each request's tokens and logprobs equal the base
model with its adapter (golden from scripts/make_lora_golden.py), alone and in one batch mixing
four adapters and the base; slots, LRU eviction, replacement and unloading while requests run;
prefix-cache isolation; the server's adapters by model name, its load and unload routes, and the
errors of adapters that do not fit."""

from __future__ import annotations

import json
import shutil
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from jaxserve.config import ModelConfig
from jaxserve.lora_request import LoRARequest
from tests.conftest import SMALL_ENGINE, fixture_dir, log_softmax, run_with_devices, tiny_server

LORA = Path(__file__).parent / "fixtures" / "lora"
NAMES = ("alpha", "beta", "gamma", "delta")  # ranks 8, 4 (rsLoRA), 16 (attention), 2 (MLP)
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, warmup=False)


def lora(name: str, lora_int_id: int | None = None) -> LoRARequest:
    return LoRARequest(name, lora_int_id or NAMES.index(name) + 1, str(LORA / name))


def golden(name: str | None) -> dict:
    return dict(np.load((LORA / name if name else fixture_dir("llama")) / "golden.npz"))


def greedy(num_tokens: int = 8, **extra):
    from jaxserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, **extra)


def assert_golden(output, name: str | None) -> None:
    """Tokens, their logprobs and the prompt's logprobs as transformers + peft compute them."""
    g = golden(name)
    ids = g["greedy_ids"].tolist()
    completion = output.outputs[0]
    assert list(completion.token_ids) == ids, name
    if completion.logprobs is not None:
        got = [step[t].logprob for step, t in zip(completion.logprobs, ids, strict=True)]
        want = log_softmax(g["decode_logits"])[np.arange(len(ids)), ids]
        np.testing.assert_allclose(got, want, atol=1e-4)
    if output.prompt_logprobs is not None:
        prompt = g["prompt_ids"]
        got = [output.prompt_logprobs[i + 1][int(t)].logprob for i, t in enumerate(prompt[1:])]
        want = log_softmax(g["prefill_logits"])[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.fixture(scope="module")
def llm():
    from jaxserve import LLM

    with LLM(
        str(fixture_dir("llama")), enable_lora=True, max_loras=4, max_cpu_loras=8, **ENGINE
    ) as llm:
        yield llm


def prompt() -> list[int]:
    return golden(None)["prompt_ids"].tolist()


def test_a_batch_of_four_adapters_and_the_base_equals_peft(llm):
    params = greedy(logprobs=0, prompt_logprobs=0)
    loras = [lora(n) for n in NAMES] + [None]
    outputs = llm.generate([prompt()] * 5, params, lora_request=loras, use_tqdm=False)
    for output, name in zip(outputs, [*NAMES, None], strict=True):
        assert_golden(output, name)


def test_the_reduced_form_of_the_product_serves_the_same_tokens(monkeypatch):
    """The dense product's decode form on the GPU (float32 sums, no GEMM: ``reference.form``),
    forced here for every step: four adapters and the base in one batch equal the goldens."""
    from jaxserve import LLM
    from pallas_kernels.lora import reference

    monkeypatch.setenv(reference.FORM_ENV, "reduced")
    params = greedy(logprobs=0, prompt_logprobs=0)
    loras = [lora(n) for n in NAMES] + [None]
    with LLM(str(fixture_dir("llama")), enable_lora=True, max_loras=4, **ENGINE) as llm:
        outputs = llm.generate([prompt()] * 5, params, lora_request=loras, use_tqdm=False)
    for output, name in zip(outputs, [*NAMES, None], strict=True):
        assert_golden(output, name)


def test_each_adapter_alone_and_the_base_with_adapters_loaded(llm):
    params = greedy(logprobs=0)
    for name in NAMES:
        (output,) = llm.generate(prompt(), params, lora_request=lora(name), use_tqdm=False)
        assert_golden(output, name)
    (output,) = llm.generate(prompt(), params, use_tqdm=False)
    assert_golden(output, None)


def test_the_prefix_cache_never_shares_blocks_between_adapters(llm):
    core = llm.engine
    long_prompt = prompt()[::-1] * 3  # several full blocks, new to this engine
    first = llm.generate(long_prompt, greedy(2), lora_request=lora("alpha"), use_tqdm=False)
    other = llm.generate(long_prompt, greedy(2), lora_request=lora("beta"), use_tqdm=False)
    again = llm.generate(long_prompt, greedy(2), lora_request=lora("beta"), use_tqdm=False)
    assert other[0].num_cached_tokens == 0  # alpha's blocks are not beta's
    assert again[0].num_cached_tokens > 0  # beta's own blocks are
    assert list(again[0].outputs[0].token_ids) == list(other[0].outputs[0].token_ids)
    assert list(first[0].outputs[0].token_ids) != list(other[0].outputs[0].token_ids)
    assert core.kv.usage == 0.0


def test_a_replaced_adapter_serves_new_requests_while_running_ones_finish_on_the_old(llm):
    """The engine's view of a replacement: a new id for the name, the old one removed."""
    core = llm.engine
    old = LoRARequest("tuned", 101, str(LORA / "alpha"))
    core.add_request("old", prompt(), greedy(), lora_request=old)
    deltas = []
    for _ in range(3):  # the old request is running
        deltas += core.step()
    new = LoRARequest("tuned", 102, str(LORA / "beta"))
    core.add_lora(new)
    core.remove_lora(old.lora_int_id)
    core.add_request("new", prompt(), greedy(), lora_request=new)
    while core.has_work():
        deltas += core.step()
    tokens: dict[str, list[int]] = {"old": [], "new": []}
    for out in deltas:
        tokens[out.request_id] += out.outputs[0].token_ids
    assert tokens["old"] == golden("alpha")["greedy_ids"].tolist()
    assert tokens["new"] == golden("beta")["greedy_ids"].tolist()
    assert not core.lora_slots.has_lora(101)


def test_least_recently_used_adapters_are_evicted_from_one_slot():
    """Also with warm-up on: the compiled programs take the adapter inputs."""
    from jaxserve import LLM

    engine = ENGINE | {"warmup": True, "max_num_batched_tokens": 32, "max_num_seqs": 4}
    with LLM(
        str(fixture_dir("llama")), enable_lora=True, max_loras=1, max_cpu_loras=2, **engine
    ) as llm:
        slots = llm.engine.lora_slots
        for name in ("alpha", "beta", "gamma", "alpha"):
            (output,) = llm.generate(prompt(), greedy(), lora_request=lora(name), use_tqdm=False)
            assert_golden(output, name)
            assert slots.num_host_adapters <= 2
        assert slots.num_loads == 4  # each change of adapter took the one slot
        # Two adapters with one slot in one call: one waits for the other's slot.
        outputs = llm.generate(
            [prompt()] * 3, greedy(), lora_request=[lora("beta"), lora("gamma"), None]
        )
        for output, name in zip(outputs, ["beta", "gamma", None], strict=True):
            assert_golden(output, name)


TENSOR_PARALLEL_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    from jaxserve import LLM, LoRARequest, SamplingParams
    lora = "tests/fixtures/lora/"
    names = ("alpha", "beta", "gamma", "delta")
    prompt = np.load("tests/fixtures/models/llama/golden.npz")["prompt_ids"].tolist()
    with LLM("tests/fixtures/models/llama", tensor_parallel_size=2, enable_lora=True,
             max_loras=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        loras = [LoRARequest(n, i + 1, lora + n) for i, n in enumerate(names)] + [None]
        outputs = llm.generate([prompt] * 5, params, lora_request=loras, use_tqdm=False)
        layer = llm.engine.lora_slots.weights.layers[0]
        shards = {name: list(getattr(layer, name).addressable_shards[0].data.shape)
                  for name in ("qkv_a", "q_b", "k_b", "o_a", "o_b", "gate_b", "down_a")}
        for out, name in zip(outputs, [*names, None]):
            c = out.outputs[0]
            print(json.dumps({"name": name, "tokens": list(c.token_ids), "shards": shards,
                              "logprobs": [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]}))
""")


def test_tensor_parallel_on_two_devices_equals_peft():
    """TP=2 (virtual CPU devices): the stacks split as their base projections (B of q, k,
    gate on the output, A of o and down on the input), four adapters and the base in one batch
    (warm-up on: the compiled steps take the stacks with their shardings)."""
    stdout = run_with_devices(TENSOR_PARALLEL_SCRIPT, 2, timeout=600)
    runs = [json.loads(line) for line in stdout.strip().splitlines()]
    assert [r["name"] for r in runs] == [*NAMES, None]
    # M = 4 slots, R = 16, H = 64, N * D = 64 (2 x 32 per device), K * D = 32, I = 96.
    assert runs[0]["shards"] == {
        "qkv_a": [4, 48, 64], "q_b": [4, 16, 32], "k_b": [4, 16, 16], "o_a": [4, 16, 32],
        "o_b": [4, 16, 64], "gate_b": [4, 16, 48], "down_a": [4, 16, 48],
    }  # fmt: skip
    for run in runs:
        g = golden(run["name"])
        ids = g["greedy_ids"].tolist()
        assert run["tokens"] == ids, run["name"]
        want = log_softmax(g["decode_logits"])[np.arange(len(ids)), ids]
        np.testing.assert_allclose(run["logprobs"], want, atol=1e-4)


# -- adapters that do not fit -----------------------------------------------------------------


def llama_shapes(max_rank: int = 16, family: str = "llama"):
    from jaxserve.models.families.registry import load_model_config
    from jaxserve.models.lora import lora_shapes

    config: ModelConfig = load_model_config(fixture_dir(family))
    return lora_shapes(config, 2, max_rank)


def copy_adapter(tmp_path: Path, name: str = "alpha", **config_changes) -> Path:
    path = tmp_path / name
    shutil.copytree(LORA / name, path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | config_changes))
    return path


@pytest.mark.parametrize(
    ("changes", "max_rank", "words"),
    [
        ({}, 4, ["r=8", "--max-lora-rank=4"]),
        ({"target_modules": ["q_proj", "lm_head"]}, 16, ["target_modules", "'lm_head'"]),
        ({"use_dora": True}, 16, ["use_dora"]),
        ({"peft_type": "IA3"}, 16, ["peft_type"]),
    ],
)
def test_an_adapter_config_that_does_not_fit_names_the_field(tmp_path, changes, max_rank, words):
    from jaxserve.models.loading.peft_adapter import AdapterError, load_adapter

    with pytest.raises(AdapterError) as info:
        load_adapter(copy_adapter(tmp_path, **changes), llama_shapes(max_rank))
    for word in words:
        assert word in str(info.value)


def test_an_adapter_of_another_base_model_names_the_module_and_shapes(tmp_path):
    from jaxserve.models.loading.peft_adapter import AdapterError, load_adapter

    with pytest.raises(AdapterError) as info:
        load_adapter(LORA / "alpha", llama_shapes(family="qwen3"))  # head_dim 32, not 16
    message = str(info.value)
    assert "_proj" in message and "lora_A" in message and "tests/fixtures/models/llama" in message
    with pytest.raises(AdapterError, match="does not exist"):
        load_adapter(tmp_path / "missing", llama_shapes())


def test_the_stacked_product_equals_the_grouped_matmul():
    import jax
    import jax.numpy as jnp

    from jaxserve.models import lora as ops

    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (12, 16))
    a = jax.random.normal(keys[1], (3, 4, 16))  # [M, R, X]
    b = jax.random.normal(keys[2], (3, 4, 8))
    slots = jnp.array([0, 2, 1, 3, 2, 0, 1, 1, 3, 0, 2, 2], jnp.int32)
    onehot = (slots[:, None] == jnp.arange(1, 4)[None]).astype(x.dtype)
    dense = ops.lora_delta(x, a, b, onehot)
    ragged = ops.lora_delta_ragged(x, a, b, slots)
    want = jnp.stack(
        [x[t] @ a[s - 1].T @ b[s - 1] if s else jnp.zeros(8) for t, s in enumerate(slots.tolist())]
    )
    np.testing.assert_allclose(dense, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ragged, want, rtol=1e-5, atol=1e-5)


# -- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    modules = (lora("alpha"), LoRARequest("beta", 2, str(LORA / "beta"), "llama"))
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    settings = {"lora_modules": modules, "api_key": "key"}
    engine = {**SMALL_ENGINE, "max_num_seqs": 8, "enable_lora": True, "max_loras": 2}
    try:
        with tiny_server("llama", settings, **engine) as served:
            yield served
    finally:
        mp.undo()


def complete(served, model: str) -> list[float]:
    """The logprobs of the greedy completion of the golden prompt by ``model``."""
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="key", max_retries=0) as client:
        out = client.completions.create(
            model=model,
            prompt=prompt(),
            temperature=0.0,
            max_tokens=8,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
    return out.choices[0].logprobs.token_logprobs


def assert_served_golden(served, model: str, name: str | None) -> None:
    """The logprobs of the golden tokens of adapter ``name`` (a different token, or other
    weights, would give others)."""
    g = golden(name)
    ids = g["greedy_ids"]
    want = log_softmax(g["decode_logits"])[np.arange(len(ids)), ids]
    np.testing.assert_allclose(complete(served, model), want, atol=1e-4)


def test_the_openai_sdk_picks_an_adapter_by_model_name(server):
    assert_served_golden(server, "alpha", "alpha")
    assert_served_golden(server, "beta", "beta")
    assert_served_golden(server, "llama", None)
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer key"}).json()
    cards = {m["id"]: m for m in models["data"]}
    assert cards["alpha"]["parent"] == "llama" and cards["alpha"]["root"] == str(LORA / "alpha")
    assert cards["beta"]["parent"] == "llama" and cards["llama"]["parent"] is None


def test_a_response_names_the_adapter_it_ran_on(server):
    """As vLLM answers: ``model`` is the adapter's name for a request on one (completions,
    chat, streamed chunks), the served model's otherwise."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="key", max_retries=0) as client:
        for model in ("alpha", "llama"):
            out = client.completions.create(model=model, prompt=prompt(), max_tokens=2)
            assert out.model == model
            chat = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.model == model
            stream = client.completions.create(
                model=model, prompt=prompt(), max_tokens=2, stream=True
            )
            assert {chunk.model for chunk in stream} == {model}


def test_unknown_adapter_is_404_and_a_bad_one_is_400_while_serving(server, tmp_path):
    auth = {"Authorization": "Bearer key"}
    body = {"model": "nope", "prompt": "hi", "max_tokens": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=auth).status_code == 404
    bad = copy_adapter(tmp_path, r=64)
    url = f"{server.url}/v1/load_lora_adapter"
    r = httpx.post(url, json={"lora_name": "bad", "lora_path": str(bad)}, headers=auth)
    assert r.status_code == 400 and "--max-lora-rank=16" in r.json()["error"]["message"]
    no_key = httpx.post(url, json={"lora_name": "x", "lora_path": str(LORA / "gamma")})
    assert no_key.status_code == 401
    assert_served_golden(server, "alpha", "alpha")


def test_load_replace_and_unload_adapters_at_run_time(server):
    auth = {"Authorization": "Bearer key"}
    load = f"{server.url}/v1/load_lora_adapter"
    body = {"lora_name": "live", "lora_path": str(LORA / "gamma")}
    assert httpx.post(load, json=body, headers=auth).status_code == 200
    assert_served_golden(server, "live", "gamma")
    body = {"lora_name": "live", "lora_path": str(LORA / "delta")}
    assert httpx.post(load, json=body, headers=auth).status_code == 200
    assert_served_golden(server, "live", "delta")
    unload = f"{server.url}/v1/unload_lora_adapter"
    assert httpx.post(unload, json={"lora_name": "live"}, headers=auth).status_code == 200
    assert httpx.post(unload, json={"lora_name": "live"}, headers=auth).status_code == 404
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "live", "prompt": "hi", "max_tokens": 1},
        headers=auth,
    )
    assert r.status_code == 404


def test_lora_modules_flag_parses_both_forms():
    from jaxserve.server.lora import parse_lora_module

    assert parse_lora_module("a=/x", 1) == LoRARequest("a", 1, "/x")
    spec = '{"name": "b", "path": "/y", "base_model_name": "m"}'
    assert parse_lora_module(spec, 2) == LoRARequest("b", 2, "/y", "m")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("nopath", 3)


def test_lora_requests_info_names_running_and_waiting_adapters_through_the_server():
    """One slot, two adapters: alpha's long request runs and holds it, beta's waits; vLLM's
    gauge says so on /metrics, then empties when both finish."""
    import threading

    from tests.test_metrics_vllm import samples

    modules = (lora("alpha"), lora("beta"))
    engine = {**SMALL_ENGINE, "max_num_seqs": 4, "enable_lora": True, "max_loras": 1}
    with tiny_server("llama", {"lora_modules": modules}, min_step_s=0.05, **engine) as served:

        def complete(model: str, max_tokens: int) -> None:
            body = {"model": model, "prompt": prompt(), "max_tokens": max_tokens,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text

        def gauge() -> dict:
            text = httpx.get(f"{served.url}/metrics").text
            (info,) = samples(text)["vllm:lora_requests_info"]
            return info.labels

        threads = [threading.Thread(target=complete, args=("alpha", 60))]
        threads[0].start()
        deadline = time.monotonic() + 30
        while gauge()["running_lora_adapters"] != "alpha":
            assert time.monotonic() < deadline, gauge()
            time.sleep(0.02)
        threads.append(threading.Thread(target=complete, args=("beta", 2)))
        threads[1].start()
        seen = gauge()
        while seen["waiting_lora_adapters"] != "beta":
            assert time.monotonic() < deadline, seen
            time.sleep(0.02)
            seen = gauge()
        assert seen == {"max_lora": "1", "running_lora_adapters": "alpha",
                        "waiting_lora_adapters": "beta"}  # fmt: skip
        for thread in threads:
            thread.join(timeout=60)
        final = gauge()
        assert final["running_lora_adapters"] == final["waiting_lora_adapters"] == ""
