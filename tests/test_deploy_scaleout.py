"""The llm-d and KServe manifests (``deploy/llm-d/``, ``deploy/kserve/``): the pods they run
validate strictly as Kubernetes pods, their ``jaxserve launch`` flags parse with the real
parser, and the scheduler's config agrees with what the pods publish (KV-event port and topic,
block size, model name). The custom resources (LLMInferenceService, EndpointPickerConfig) and
the Helm values have no schema here: their structure and every field relied on is asserted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
LLMD = ROOT / "deploy" / "llm-d"
KSERVE = ROOT / "deploy" / "kserve" / "llminferenceservice.yaml"
KUBERNETES_VERSION = "1.37.0"
# Keys of a model service container that the llm-d chart reads itself (not a pod field).
CHART_KEYS = ("modelCommand", "mountModelVolume")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def as_pod(spec: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec}


def modelservice_pod() -> dict:
    decode = load(LLMD / "modelservice-values.yaml")["decode"]
    containers = [{k: v for k, v in c.items() if k not in CHART_KEYS} for c in decode["containers"]]
    return {"containers": containers, "volumes": decode["volumes"]}


def kserve_pod() -> dict:
    return load(KSERVE)["spec"]["template"]


def launch_args(args: list[str]) -> tuple[object, dict]:
    """The args parsed by ``jaxserve launch``'s parser, and ``--kv-events-config`` decoded.
    Where this tree's parser does not know that flag yet, it is parsed without it."""
    from jaxserve.cli import build_parser

    i = args.index("--kv-events-config")
    events = json.loads(args[i + 1])
    parser = build_parser(["launch"])
    known = any("--kv-events-config" in a.option_strings for a in parser._actions)
    rest = args if known else args[:i] + args[i + 2 :]
    return parser.parse_args(["launch", *rest]), events


@pytest.mark.parametrize("pod", [modelservice_pod, kserve_pod], ids=["llm-d", "kserve"])
def test_the_pods_validate_strictly_and_serve_what_the_scheduler_reads(pod):
    spec = pod()
    kubernetes_validate.validate(as_pod(spec), KUBERNETES_VERSION, strict=True)
    (main,) = spec["containers"]
    assert main["command"] == ["jaxserve", "launch"]
    args, events = launch_args(main["args"])
    assert args.served_model_name == ["model"] and args.block_size == 16
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "kv@$(POD_IP)@model",
    }
    # $(POD_IP) is expanded by the kubelet from an env variable of the container
    (pod_ip,) = [e for e in main["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": args.port, "kv-events": 5557}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/health", "port": "http"}
    resources = main["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == args.tensor_parallel_size


def test_strict_validation_of_a_pod_has_teeth():
    spec = kserve_pod()
    spec["containers"][0]["readinessProbes"] = spec["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        kubernetes_validate.validate(as_pod(spec), KUBERNETES_VERSION, strict=True)


def check_picker_config(config: dict) -> dict[str, dict]:
    """An EndpointPickerConfig's structure; its plugins by type."""
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    for ref in profile["plugins"]:
        assert ref["pluginRef"] in plugins
        assert isinstance(ref.get("weight", 1.0), float | int)
    assert {"kv-cache-utilization-scorer", "queue-scorer", "max-score-picker"} <= plugins.keys()
    return plugins


@pytest.mark.parametrize("name", ["epp-config.yaml", "epp-config-approximate.yaml"])
def test_the_scheduler_configs_are_well_formed(name):
    plugins = check_picker_config(load(LLMD / name))
    assert ("precise-prefix-cache-scorer" in plugins) != ("prefix-cache-scorer" in plugins)


def test_the_scheduler_subscribes_to_what_the_replicas_publish():
    precise = check_picker_config(load(LLMD / "epp-config.yaml"))["precise-prefix-cache-scorer"]
    args, events = launch_args(modelservice_pod()["containers"][0]["args"])
    assert precise["tokenProcessorConfig"]["blockSize"] == args.block_size
    kv = precise["kvEventsConfig"]
    assert events["topic"].startswith(kv["topicFilter"])
    assert kv["discoverPods"] is True
    assert f":{kv['podDiscoveryConfig']['socketPort']}" in events["endpoint"]
    assert precise["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == "model"
    # KServe's inline config is the same file
    inline = load(KSERVE)["spec"]["router"]["scheduler"]["config"]["inline"]
    assert inline == load(LLMD / "epp-config.yaml")


def test_the_model_service_and_pool_select_the_same_pods():
    values = load(LLMD / "modelservice-values.yaml")
    pool = load(LLMD / "gaie-values.yaml")
    labels = values["modelArtifacts"]["labels"]
    assert pool["inferencePool"]["modelServers"]["matchLabels"].items() <= labels.items()
    assert pool["inferencePool"]["targetPortNumber"] == values["routing"]["servicePort"] == 8000
    assert pool["inferenceExtension"]["pluginsConfigFile"] == "epp-config.yaml"
    args, _ = launch_args(values["decode"]["containers"][0]["args"])
    assert values["decode"]["parallelism"]["tensor"] == args.tensor_parallel_size
    assert values["modelArtifacts"]["name"] == args.served_model_name[0]
    assert values["decode"]["containers"][0]["args"][0].startswith(
        values["modelArtifacts"]["mountPath"]
    )
    flags = pool["inferenceExtension"]["flags"]
    for metric in flags.values():
        assert re.fullmatch(r"vllm:[a-z_]+", metric)


def test_the_kserve_service_names_its_model_and_replicas():
    service = load(KSERVE)
    assert service["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert service["kind"] == "LLMInferenceService"
    spec = service["spec"]
    assert spec["model"]["name"] == "model" and re.match(r"(pvc|hf|s3)://", spec["model"]["uri"])
    assert spec["replicas"] >= 2 and {"route", "gateway", "scheduler"} <= spec["router"].keys()
    (main,) = spec["template"]["containers"]
    assert main["name"] == "main" and main["args"][0] == "/mnt/models"
    grace = spec["template"]["terminationGracePeriodSeconds"]
    args, _ = launch_args(main["args"])
    assert grace > main["lifecycle"]["preStop"]["sleep"]["seconds"] + args.shutdown_timeout + 5
