"""New weights for a running engine (``LLM.update_weights``, ``LLM.update_weights_from_disk``):
served from the next generate, equal to a fresh engine on those weights, without a compile;
weights that do not fit change nothing; the prefix cache is cleared."""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.engine.llm import LLM
from jaxserve.models.loading.load_progress import format_bytes
from jaxserve.runner.sleep import device_bytes
from jaxserve.runner.weight_update import WeightsUpdateError
from jaxserve.sampling_params import SamplingParams
from tests.conftest import SMALL_ENGINE, fixture_dir

PROMPTS = [[5, 17, 40, 41, 2, 9], [7, 7, 7, 100, 3]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def make_llm(model: Path) -> LLM:
    return LLM(str(model), dtype="float32", **SMALL_ENGINE)


def sample(llm: LLM) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens of ``PROMPTS`` and their logprobs."""
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    logprobs = [
        [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)] for o in outs
    ]
    return [list(o.token_ids) for o in outs], np.array(logprobs)


def copy_model(tmp_path: Path, name: str, change) -> Path:
    """The llama fixture with ``change(tensors)`` applied to its safetensors."""
    source = fixture_dir("llama")
    target = tmp_path / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("golden.npz"))
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def scaled(tensors: dict[str, np.ndarray]) -> None:
    rng = np.random.default_rng(0)
    for name, value in tensors.items():
        if "norm" not in name:
            noise = rng.standard_normal(value.shape).astype(value.dtype)
            tensors[name] = value + noise * np.abs(value).mean()


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> tuple[Path, list[list[int]], np.ndarray, object]:
    """Another checkpoint of the same shapes, and what a fresh engine on it samples."""
    path = copy_model(tmp_path_factory.mktemp("models"), "other", scaled)
    fresh = make_llm(path)
    tokens, logprobs = sample(fresh)
    weights = jax.tree.map(np.asarray, fresh.weights)  # on the host, as a trainer might hand them
    fresh.shutdown()
    return path, tokens, logprobs, weights


def text_of(path: Path, prompt: list[int]) -> str:
    """What a fresh engine on ``path`` answers ``complete`` with."""
    fresh = make_llm(path)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text = fresh.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].text
    fresh.shutdown()
    return text


@pytest.fixture(scope="module")
def llm():
    engine = make_llm(fixture_dir("llama"))
    yield engine
    engine.shutdown()


def test_weights_from_disk_sample_as_a_fresh_engine_does(llm, other) -> None:
    path, tokens, logprobs, _ = other
    before, _ = sample(llm)
    assert before != tokens  # the other weights sample other tokens
    num_programs = llm.engine.runner.programs.step_fn._cache_size()
    seconds = llm.update_weights_from_disk(path)
    assert seconds >= 0
    after, after_logprobs = sample(llm)
    assert after == tokens
    np.testing.assert_allclose(after_logprobs, logprobs, rtol=1e-5, atol=1e-5)
    assert llm.engine.runner.programs.step_fn._cache_size() == num_programs  # nothing compiled
    llm.update_weights_from_disk(fixture_dir("llama"))  # and back
    assert sample(llm)[0] == before


def test_weights_from_a_pytree_sample_as_a_fresh_engine_does(llm, other) -> None:
    _, tokens, logprobs, host_weights = other
    before, _ = sample(llm)
    served = llm.weights
    llm.update_weights(host_weights)  # numpy leaves: placed on the device, as served
    after, after_logprobs = sample(llm)
    assert after == tokens
    np.testing.assert_allclose(after_logprobs, logprobs, rtol=1e-5, atol=1e-5)
    leaves = jax.tree.leaves(llm.weights)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    assert [leaf.dtype for leaf in leaves] == [leaf.dtype for leaf in jax.tree.leaves(served)]
    llm.update_weights(served)  # device arrays of the served dtype: served as they are
    pairs = zip(jax.tree.leaves(llm.weights), jax.tree.leaves(served), strict=True)
    assert all(a is b for a, b in pairs)
    assert sample(llm)[0] == before


def test_weights_that_do_not_fit_change_nothing(llm, tmp_path) -> None:
    before, _ = sample(llm)
    served = llm.weights
    wrong = jax.tree.map(lambda x: x, served)
    wrong.layers[0].mlp_norm = np.ones(3, np.float32)
    with pytest.raises(WeightsUpdateError, match=r"\.layers\[0\]\.mlp_norm: shape \(3,\)"):
        llm.update_weights(wrong)
    with pytest.raises(WeightsUpdateError, match=r"\.embed: missing"):
        llm.update_weights({"lm_head": served.lm_head})
    with pytest.raises(WeightsUpdateError, match="the whole tree: not a weight of this model"):
        llm.update_weights(object())  # not a pytree: one leaf, at no weight's path

    def cut(tensors: dict[str, np.ndarray]) -> None:
        name = "model.layers.1.mlp.down_proj.weight"
        tensors[name] = tensors[name][:, :-1].copy()

    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        llm.update_weights_from_disk(copy_model(tmp_path, "cut", cut))
    assert llm.weights is served
    assert sample(llm)[0] == before


def test_an_update_clears_the_prefix_cache_and_runs_between_requests(llm, other) -> None:
    """A running sequence refuses an update; a request queued meanwhile waits for it and
    starts on the new weights."""
    _, tokens, _, host_weights = other
    before, _ = sample(llm)
    assert llm.engine.kv.pool.cached  # the prompts' blocks stay cached for the next request
    served = llm.weights
    llm.update_weights(served)
    assert not llm.engine.kv.pool.cached
    held = llm.weights
    llm.engine.add_request("running", PROMPTS[0], PARAMS)
    llm.engine.step()
    with pytest.raises(RuntimeError, match="1 sequences are running"):
        llm.update_weights(host_weights)
    assert llm.weights is held
    llm.engine.abort_request("running")
    llm.engine.add_request("queued", PROMPTS[0], PARAMS)
    llm.update_weights(host_weights)  # the abort taken, the queued request not started
    assert llm.engine.scheduler.is_admitting
    deltas = [o for _ in range(50) for o in llm.engine.step()]
    assert {o.request_id for o in deltas} == {"queued"} and deltas[-1].finished
    queued = deltas[0]
    for delta in deltas[1:]:
        queued.merge(delta)
    assert list(queued.outputs[0].token_ids) == tokens[0]  # the new weights' tokens
    llm.update_weights(served)
    assert sample(llm)[0] == before


# -- over HTTP: POST /update_weights_from_disk ---------------------------------------------------

KEY = "weights-key"


@pytest.fixture(scope="module")
def server():
    from tests.conftest import tiny_server

    settings = {"api_key": KEY, "enable_weight_updates": True}
    with tiny_server("updated", settings, min_step_s=0.01, **SMALL_ENGINE) as running:
        yield running


def complete(client, prompt: list[int], max_tokens: int = 6) -> str:
    body = {"model": "updated", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    response = client.post("/v1/completions", json={**body, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_the_route_serves_another_checkpoint_and_back(server, other) -> None:
    import httpx

    path = other[0]
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as client:
        before = complete(client, PROMPTS[0])
        assert httpx.post(f"{server.url}/update_weights_from_disk", json={}).status_code == 401
        done = client.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert done.status_code == 200 and done.json()["success"] is True
        assert done.json()["load_seconds"] >= 0 and str(path) in done.json()["message"]
        assert complete(client, PROMPTS[0]) == text_of(path, PROMPTS[0])
        for body, words in [
            ({"model_path": str(path / "missing")}, "missing"),
            ({"model_path": 3}, "model_path must be"),
            ([1], "model_path must be"),
        ]:
            refused = client.post("/update_weights_from_disk", json=body)
            assert refused.status_code == 400 and refused.json()["success"] is False
            assert words in refused.json()["message"]
        back = client.post(
            "/update_weights_from_disk", json={"model_path": str(fixture_dir("llama"))}
        )
        assert back.status_code == 200
        assert complete(client, PROMPTS[0]) == before


def test_a_running_request_finishes_on_the_weights_it_started_with(server, other) -> None:
    """The update waits for the sequences that run; a request sent during it waits and gets
    the new weights."""
    import concurrent.futures

    import httpx

    path = other[0]
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as client:
        old_long = complete(client, PROMPTS[1], max_tokens=40)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = pool.submit(complete, client, PROMPTS[1], 40)
            wait_until(lambda: server.engine.core.scheduler.running)  # until it runs
            update = pool.submit(
                client.post, "/update_weights_from_disk", json={"model_path": str(path)}
            )
            wait_until(lambda: not server.engine.core.scheduler.is_admitting)  # the update waits
            waiting = pool.submit(complete, client, PROMPTS[0])
            assert running.result() == old_long
            assert update.result().status_code == 200
            assert waiting.result() == text_of(path, PROMPTS[0])
        client.post("/update_weights_from_disk", json={"model_path": str(fixture_dir("llama"))})


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_the_route_is_off_unless_enabled() -> None:
    import httpx

    from tests.conftest import tiny_server

    with tiny_server("plain", **SMALL_ENGINE) as plain:
        response = httpx.post(f"{plain.url}/update_weights_from_disk", json={"model_path": "x"})
        assert response.status_code == 404


# -- sleep and wake ------------------------------------------------------------------------------


def live_device_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def test_sleep_gives_the_device_memory_up_and_wake_restores_the_same_model(llm, caplog) -> None:
    """Each level gives the memory up and the wake brings the same model back, compiling
    nothing; each says in the log how long it took and what it moved (as vLLM's do)."""
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        llm.sleep(1)  # the module's engine runs without sleep mode
    sleepy = LLM(str(fixture_dir("llama")), dtype="float32", enable_sleep_mode=True, **SMALL_ENGINE)
    before, logprobs = sample(sleepy)
    runner = sleepy.engine.runner
    held, live = runner.device_bytes(), live_device_bytes()
    num_programs = runner.programs.step_fn._cache_size()
    weights_held = format_bytes(device_bytes(runner.weights))
    kv_held = format_bytes(device_bytes(runner.kv_cache))
    for level in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jaxserve.runner.sleep"):
            sleepy.sleep(level)
        moved = (
            f"{weights_held} of weights copied to pinned host memory in"
            if level == 1
            else f"{weights_held} of weights dropped"
        )
        assert re.search(
            rf"Asleep \(level {level}\) in [\d.]+ s: {re.escape(moved)}.*the KV cache's "
            rf"{re.escape(kv_held)} freed",
            caplog.text,
        ), caplog.text
        assert sleepy.is_sleeping and runner.device_bytes() == 0
        assert live - live_device_bytes() >= 0.95 * held  # given back, not only forgotten
        assert not sleepy.engine.kv.pool.cached  # the KV cache wakes empty
        with pytest.raises(RuntimeError, match="asleep"):
            sample(sleepy)
        with pytest.raises(RuntimeError, match="asleep already"):
            sleepy.sleep(1)
        with caplog.at_level(logging.INFO, logger="jaxserve.runner.sleep"):
            sleepy.wake_up(["weights"])
            assert sleepy.is_sleeping  # the KV cache still sleeps
            sleepy.wake_up(["kv_cache"])
        source = "host memory" if level == 1 else "their source"
        assert re.search(rf"Partly awake in [\d.]+ s: the weights from {source} in", caplog.text)
        assert re.search(r"\bAwake in [\d.]+ s: the KV cache in [\d.]+ s", caplog.text)
        assert not sleepy.is_sleeping and runner.device_bytes() == held
        again, again_logprobs = sample(sleepy)
        assert again == before
        np.testing.assert_array_equal(again_logprobs, logprobs)
    assert runner.programs.step_fn._cache_size() == num_programs  # nothing compiled again
    with pytest.raises(ValueError, match="level=3 must be 1"):
        sleepy.sleep(3)
    with pytest.raises(ValueError, match="must name some of weights, kv_cache"):
        sleepy.wake_up(["optimizer"])
    sleepy.shutdown()


def memory_kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def test_level_1_keeps_the_weights_in_pinned_host_memory_and_serves_them_committed() -> None:
    """Level 1's copy is in pinned host memory (one DMA each way: waking the Llama-3-8B shape
    from numpy arrays took 7.6 s on an H200), and what comes back is committed to its device.
    So are the served weights from the start, after an update with a trainer's uncommitted
    arrays, and the KV cache: a program's signature stays the one it compiled for."""
    sleepy = LLM(str(fixture_dir("llama")), dtype="float32", enable_sleep_mode=True, **SMALL_ENGINE)
    runner = sleepy.engine.runner
    before, _ = sample(sleepy)
    num_programs = runner.programs.step_fn._cache_size()

    def all_committed() -> bool:
        leaves = jax.tree.leaves(runner.weights) + jax.tree.leaves(runner.kv_cache)
        return all(leaf.committed for leaf in leaves)

    assert all_committed()
    trainer = jax.tree.map(lambda a: jax.device_put(np.asarray(a)), runner.weights)
    assert not any(leaf.committed for leaf in jax.tree.leaves(trainer))
    sleepy.update_weights(trainer)
    assert all_committed() and sample(sleepy)[0] == before
    sleepy.sleep(1)
    assert memory_kinds(runner.asleep.host_weights) == {"pinned_host"}
    sleepy.wake_up()
    assert memory_kinds(runner.weights) == {"device"} and all_committed()
    assert sample(sleepy)[0] == before
    assert runner.programs.step_fn._cache_size() == num_programs  # nothing compiled again
    sleepy.shutdown()


def test_level_1_falls_back_to_numpy_without_pinned_host_memory(monkeypatch, caplog) -> None:
    """A backend without pinned host memory keeps level 1's copy in numpy arrays."""
    from jaxserve.runner import sleep

    real_put = jax.device_put

    def no_pinned(x, device=None, **kwargs):
        kinds = {getattr(s, "memory_kind", None) for s in jax.tree.leaves(device)}
        if "pinned_host" in kinds:
            raise ValueError("memory kind pinned_host is not supported here")
        return real_put(x, device, **kwargs)

    sleepy = LLM(str(fixture_dir("llama")), dtype="float32", enable_sleep_mode=True, **SMALL_ENGINE)
    before, _ = sample(sleepy)
    monkeypatch.setattr(sleep.jax, "device_put", no_pinned)
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.sleep"):
        sleepy.sleep(1)
    assert "of weights copied to host memory in" in caplog.text
    host = sleepy.engine.runner.asleep.host_weights
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(host))
    sleepy.wake_up()
    assert sample(sleepy)[0] == before
    sleepy.shutdown()


def test_the_server_sleeps_and_wakes() -> None:
    import httpx

    from tests.conftest import tiny_server

    with tiny_server("sleepy", enable_sleep_mode=True, **SMALL_ENGINE) as running:
        with httpx.Client(base_url=running.url, timeout=60) as client:
            before = complete_as(client, "sleepy", PROMPTS[0])
            assert client.post("/sleep", params={"level": 3}).status_code == 400
            assert client.post("/sleep", params={"level": 1}).status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            asleep = client.post(
                "/v1/completions", json={"model": "sleepy", "prompt": "hi", "max_tokens": 2}
            )
            assert asleep.status_code == 503 and "asleep" in asleep.text
            assert client.post("/wake_up", params={"tags": "optimizer"}).status_code == 400
            assert client.post("/wake_up").status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            assert complete_as(client, "sleepy", PROMPTS[0]) == before


def complete_as(client, model: str, prompt: list[int]) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0}
    response = client.post("/v1/completions", json={**body, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_pause_waits_aborts_or_keeps_and_resume_goes_on(server) -> None:
    """Between rollout batches: ``wait`` lets the running request finish, ``abort`` ends it,
    ``keep`` freezes it in place (its text unchanged once resumed); a request sent while
    paused waits for the resume."""
    import concurrent.futures

    import httpx

    auth = {"Authorization": f"Bearer {KEY}"}
    core = server.engine.core
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as client:
        reference = complete(client, PROMPTS[1], max_tokens=30)
        assert client.post("/pause", params={"mode": "later"}).status_code == 400
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for mode in ("wait", "abort", "keep"):
                body = {"model": "updated", "prompt": PROMPTS[1], "max_tokens": 30}
                body.update(temperature=0.0, ignore_eos=True)
                running = pool.submit(client.post, "/v1/completions", json=body)
                wait_until(lambda: core.scheduler.running)
                assert client.post("/pause", params={"mode": mode}).status_code == 200
                assert client.get("/is_paused").json() == {"is_paused": True}
                if mode == "keep":
                    assert core.scheduler.running and not running.done()
                    refused = client.post(
                        "/update_weights_from_disk", json={"model_path": str(fixture_dir("llama"))}
                    )
                    assert refused.status_code == 400 and "kept in place" in refused.text
                else:
                    choice = running.result().json()["choices"][0]
                    assert choice["finish_reason"] == ("length" if mode == "wait" else "abort")
                    assert (choice["text"] == reference) == (mode == "wait")
                waiting = pool.submit(complete, client, PROMPTS[1], 30) if mode == "wait" else None
                time.sleep(0.3)
                assert waiting is None or not waiting.done()  # it waits for the resume
                assert client.post("/resume").status_code == 200
                assert client.get("/is_paused").json() == {"is_paused": False}
                if waiting is not None:
                    assert waiting.result() == reference
                if mode == "keep":
                    assert running.result().json()["choices"][0]["text"] == reference
