"""Ray Serve (``jaxserve.integrations.ray``): the deployment's options from ``serve run``'s
``key=value`` arguments, two CPU replicas of the demo model serving the OpenAI routes
through Ray's HTTP proxy, one of them killed while requests run, and two more behind the
prefix router (``request_router=prefix``), called through a handle.

The serving test starts a local Ray (four logical CPUs) in this process; it is skipped only when
Ray itself cannot start here."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from jaxserve.engine_config import EngineConfig
from jaxserve.integrations.ray import RAY_KEYS, build_app, deployment_options, launch_argv
from jaxserve.integrations.ray_router import PromptRequest
from tests.conftest import free_port

# Ray forks its workers from a process where JAX may already run (the whole suite in one
# process): JAX's fork warning is raised while Ray starts, outside any test's control.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def test_key_values_become_serve_flags():
    argv = launch_argv({"max_model_len": "1k", "enable_prefix_caching": "false", "seed": "3"})
    assert argv == ["serve", "--max-model-len", "1k", "--no-enable-prefix-caching", "--seed", "3"]


def test_gpu_replicas_reserve_their_tensor_parallel_devices():
    options = deployment_options(dict(RAY_KEYS), EngineConfig(tensor_parallel_size=4), hosts=1)
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 4}
    assert options["num_replicas"] == 1 and "autoscaling_config" not in options


def test_tpu_and_cpu_replicas():
    tpu = deployment_options({**RAY_KEYS, "accelerator": "tpu"}, EngineConfig(), hosts=1)
    assert tpu["ray_actor_options"]["resources"] == {"TPU": 1}
    cpu = deployment_options({**RAY_KEYS, "accelerator": "cpu"}, EngineConfig(), hosts=1)
    assert cpu["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0}
    with pytest.raises(ValueError, match="accelerator='npu' must be one of gpu, tpu, cpu"):
        deployment_options({**RAY_KEYS, "accelerator": "npu"}, EngineConfig(), hosts=1)


def test_a_multi_host_replica_reserves_one_bundle_per_host():
    options = deployment_options(dict(RAY_KEYS), EngineConfig(tensor_parallel_size=16), hosts=2)
    assert options["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 8}] * 2
    assert options["placement_group_strategy"] == "STRICT_SPREAD"
    assert "ray_actor_options" not in options


def test_autoscaling_follows_the_requests_each_replica_holds():
    args = {**RAY_KEYS, "num_replicas": "auto", "max_replicas": "6", "target_ongoing_requests": "5"}
    scaling = deployment_options(args, EngineConfig(), hosts=1)["autoscaling_config"]
    assert scaling["min_replicas"] == 1 and scaling["max_replicas"] == 6
    assert scaling["target_ongoing_requests"] == 5.0


def test_the_prefix_router_is_ray_s_request_router_with_the_engine_s_block_size():
    args = {**RAY_KEYS, "request_router": "prefix"}
    router = deployment_options(args, EngineConfig(block_size=32), hosts=1)["request_router_config"]
    assert router["request_router_class"].endswith("ray_router.PrefixRequestRouter")
    assert router["request_router_kwargs"] == {"block_size": 32}
    assert "request_router_config" not in deployment_options(dict(RAY_KEYS), EngineConfig(), 1)
    with pytest.raises(ValueError, match="request_router='hash' must be one of power-of-two, p"):
        deployment_options({**RAY_KEYS, "request_router": "hash"}, EngineConfig(), hosts=1)


def test_an_unknown_key_stops_the_build_before_any_replica():
    with pytest.raises(SystemExit):
        build_app({"max_model_length": "1k"})


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray import serve

    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # only Ray failing to start on this machine skips the test
        pytest.skip(f"ray does not start here: {exc!r}")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


APP_ARGS = {
    "accelerator": "cpu",
    "num_replicas": "2",
    "max_model_len": "256",
    "max_num_seqs": "4",
    "max_num_batched_tokens": "64",
    "num_gpu_blocks_override": "128",
    "served_model_name": "demo",
}


def complete(url: str, i: int, max_tokens: int = 24) -> int:
    body = {
        "model": "demo",
        "prompt": f"def f{i}(x):",
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    try:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code
    except httpx.HTTPError:
        return -1


def test_two_cpu_replicas_serve_and_survive_one_killed(ray_cluster):
    import ray
    from ray import serve

    serve.run(build_app(APP_ARGS), name="jaxserve", route_prefix="/")
    url = ray_cluster
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "demo"
    assert complete(url, 0) == 200
    replicas = [
        name
        for name in ray.util.list_named_actors(all_namespaces=True)
        if name["name"].startswith("SERVE_REPLICA::jaxserve#jaxserve#")
    ]
    assert len(replicas) == 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # long requests (200 tokens), so that the victim still holds some when it is killed
        before = [pool.submit(complete, url, i, 200) for i in range(8)]
        actors = [ray.get_actor(r["name"], namespace=r["namespace"]) for r in replicas]
        victim = actors[0]
        # Killed once every one of the 8 has reached a replica, so that what the victim holds
        # is all it will ever have of them: read while some were still being routed, the count
        # missed one that arrived before the kill (CI runs failed 2 with held read as 1).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ongoing = ray.get([a.get_num_ongoing_requests.remote() for a in actors])
            if sum(ongoing) >= len(before):
                break
            time.sleep(0.1)
        held = ray.get(victim.get_num_ongoing_requests.remote())
        assert held >= 1  # killed mid-load
        ray.kill(victim, no_restart=True)
        after = [pool.submit(complete, url, 100 + i) for i in range(8)]
        before_codes = [f.result() for f in before]
        after_codes = [f.result() for f in after]
    # only the requests the killed replica held may fail; every later one is served
    assert sum(code != 200 for code in before_codes) <= held, (held, before_codes)
    assert after_codes == [200] * len(after)


def test_the_prefix_router_sends_a_prefix_to_one_replica(ray_cluster):
    from ray import serve

    args = {**APP_ARGS, "name": "prefix", "request_router": "prefix", "block_size": "16"}
    handle = serve.run(build_app(args), name="prefix", route_prefix="/prefix")
    systems = {key: [100 + 7 * i + key for i in range(48)] for key in (0, 1)}  # 3 blocks each
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    cached = []
    for i in range(6):
        key = i % 2
        request = PromptRequest(systems[key] + [500 + i, 600 + i], max_tokens=2, ignore_eos=True)
        items = list(handle.options(stream=True).generate.remote(request))
        assert sum(len(item["token_ids"]) for item in items) == 2
        seen[key].add(items[-1]["replica"])
        cached.append(items[-1]["num_cached_tokens"])
    assert len(seen[0]) == 1 and len(seen[1]) == 1, seen
    assert cached[:2] == [0, 0] and all(c == 48 for c in cached[2:]), cached
    # HTTP through Ray's proxy (no prompt for the router): the less loaded of two replicas
    assert complete(f"{ray_cluster}/prefix", 1, max_tokens=2) == 200
    serve.delete("prefix")
