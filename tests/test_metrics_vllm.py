"""/metrics under vLLM's names: every series a router or dashboard reads, parsed with
prometheus_client's text parser, with vLLM's labels (``model_name``, ``engine``="0"), ``_total``
counters and bucket edges; the two info series; ``--metrics-prefix``; and the Grafana dashboard
in deploy/grafana, whose every expression must name a series a running server exports."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.interfaces import EngineStats
from jaxserve.engine_config import EngineConfig
from jaxserve.server.metrics import ServerMetrics
from tests.conftest import tiny_server

MODEL = "metrics-model"
DASHBOARD = Path(__file__).parents[1] / "deploy" / "grafana" / "jaxserve.json"
VLLM_LABELS = {"model_name": MODEL, "engine": "0"}
# vllm/v1/metrics/loggers.py's bucket edges
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5]
TTFT += [10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT += [20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
LATENCY += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


@pytest.fixture(scope="module")
def server():
    with tiny_server(
        MODEL, max_model_len=64, block_size=4, num_gpu_blocks_override=32, warmup=False
    ) as server:
        for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10]):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        yield server


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_router_series_carry_vllms_names_and_labels(server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    found = samples(text)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        (sample,) = found[name]
        assert sample.labels == VLLM_LABELS, name
    assert found["vllm:num_requests_running"][0].value == 0
    assert found["vllm:generation_tokens_total"][0].value >= 6
    assert found["vllm:prefix_cache_hits_total"][0].value >= 8  # the shared two blocks
    success = {s.labels["finished_reason"]: s.value for s in found["vllm:request_success_total"]}
    assert success == {"stop": 0, "length": 2, "abort": 0, "error": 0}
    assert all(s.labels.items() >= VLLM_LABELS.items() for s in found["vllm:request_success_total"])
    # the jaxserve: twins keep their one label
    assert found["jaxserve:num_requests_waiting"][0].labels == {"model_name": MODEL}


def test_histograms_have_vllms_buckets(server) -> None:
    found = samples(httpx.get(f"{server.url}/metrics").text)
    for name, edges in (
        ("time_to_first_token_seconds", TTFT),
        ("time_per_output_token_seconds", TPOT),
        ("inter_token_latency_seconds", TPOT),
        ("e2e_request_latency_seconds", LATENCY),
        ("request_queue_time_seconds", LATENCY),
        ("request_prefill_time_seconds", LATENCY),
        ("request_decode_time_seconds", LATENCY),
        ("request_inference_time_seconds", LATENCY),
        ("request_prompt_tokens", [1, 2, 5, 10, 20, 50]),
        ("request_params_n", [1, 2, 5, 10, 20]),
    ):
        buckets = found[f"vllm:{name}_bucket"]
        assert [float(s.labels["le"]) for s in buckets] == [*edges, float("inf")], name
        assert all(s.labels["model_name"] == MODEL and s.labels["engine"] == "0" for s in buckets)
        # one observation per request; inter-token latency one per gap (3 tokens: 2 each)
        count = 4 if name == "inter_token_latency_seconds" else 2
        assert found[f"vllm:{name}_count"][0].value == count, name


def test_info_series(server) -> None:
    found = samples(httpx.get(f"{server.url}/metrics").text)
    (cache,) = found["vllm:cache_config_info"]
    assert cache.value == 1
    assert cache.labels["block_size"] == "4" and cache.labels["num_gpu_blocks"] == "32"
    assert cache.labels["cache_dtype"] == "auto" and cache.labels["engine"] == "0"
    assert cache.labels["enable_prefix_caching"] == "True"
    assert cache.labels["gpu_memory_utilization"] == "0.9"
    assert cache.labels["num_gpu_blocks_override"] == "32"
    (lora,) = found["vllm:lora_requests_info"]
    assert lora.labels == {
        "max_lora": "0",
        "waiting_lora_adapters": "",
        "running_lora_adapters": "",
    }
    assert abs(lora.value - time.time()) < 60


def fake_engine(**stats) -> SimpleNamespace:
    values = dict(
        num_running=1, num_waiting=2, kv_cache_usage=0.5, prefix_cache_queries=10,
        prefix_cache_hits=4, num_preemptions=0, prompt_tokens=7, generation_tokens=3,
        num_aborted=0, num_steps=5,
    )  # fmt: skip
    values.update(stats)
    return SimpleNamespace(stats=lambda: EngineStats(**values), config=EngineConfig())


def test_metrics_prefix_keeps_one_name() -> None:
    names = {}
    for prefix in ("both", "vllm", "jaxserve"):
        text = ServerMetrics(fake_engine(), "m", 64, prefix).render().decode()
        names[prefix] = {name.split(":")[0] for name in samples(text)}
    assert names == {"both": {"vllm", "jaxserve"}, "vllm": {"vllm"}, "jaxserve": {"jaxserve"}}
    only_vllm = ServerMetrics(fake_engine(), "m", 64, "vllm")
    only_vllm.count_rate_limited("requests")  # jaxserve's own series is not exported
    assert "rate_limited" not in only_vllm.render().decode()


def test_lora_adapters_fill_lora_requests_info() -> None:
    engine = fake_engine(max_lora=2, running_lora_adapters=("a", "b"), waiting_lora_adapters=("c",))
    text = ServerMetrics(engine, "m", 64).render().decode()
    (lora,) = samples(text)["vllm:lora_requests_info"]
    assert lora.labels == {
        "max_lora": "2",
        "waiting_lora_adapters": "c",
        "running_lora_adapters": "a,b",
    }


def test_metrics_prefix_flag() -> None:
    from jaxserve.server.launch.flags import add_launch_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    args = parser.parse_args(["--metrics-prefix", "vllm"])
    assert settings_from_args(args, "m").metrics_prefix == "vllm"
    assert settings_from_args(parser.parse_args([]), "m").metrics_prefix == "both"
    with pytest.raises(SystemExit):
        parser.parse_args(["--metrics-prefix", "sglang"])
    help_text = " ".join(parser.format_help().split())
    assert "vllm (only vLLM's series" in help_text and "jaxserve (only jaxserve:" in help_text
    assert "--kv-events-config JSON" in help_text


def test_grafana_dashboard_reads_only_exported_series(server) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = set(samples(httpx.get(f"{server.url}/metrics").text))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        names = re.findall(r"vllm:[a-z0-9_]+", expr)
        assert names, expr
        assert set(names) <= exported, (expr, set(names) - exported)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("request rate", "first token", "inter-token", "end-to-end", "waiting"):
        assert topic in titles
    for topic in ("kv-cache usage", "prefix-cache hit rate", "tokens per second"):
        assert topic in titles
