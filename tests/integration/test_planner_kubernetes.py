"""The planner's ``kubernetes`` connector reaches Kubernetes: it reads and sets the worker
Deployment's scale over HTTPS with the pod's service account, against a stand-in for the API that
authenticates the token and authorizes each call by the RBAC objects bound to it
(tests/kube_api.py); the planner overlay's own Role lets it scale its workers and nothing else; and
the planner service, deciding on a real NATS, sets the Deployment's replicas through it."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.planner.connectors import ConnectorError, make_connector
from kvmesh.planner.decision import PoolSizes
from kvmesh.planner.kubernetes import DELETION_COST, KubernetesDeployments
from kvmesh.planner.service import PlannerConfig, serve
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engines.mock.mock_engine import EngineConfig
from tests.integration.test_cache_moves import cached_on
from tests.integration.test_router_queue import up
from tests.kube_api import KubernetesApi
from tests.support import registered, router_generate, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NS = "kvmesh"


def role(name: str, resource_names: list[str] | None, verbs=("get", "patch")) -> list[dict[str, Any]]:
    rule: dict[str, Any] = {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": list(verbs)}
    if resource_names is not None:
        rule["resourceNames"] = resource_names
    return [
        {"kind": "Role", "metadata": {"name": name, "namespace": NS}, "rules": [rule]},
        {
            "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": NS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": "planner", "namespace": NS}],
        },
    ]


async def test_the_connector_reads_and_sets_each_pools_deployment(tmp_path: Path):
    deployments = {(NS, "worker"): 3, (NS, "prefill-worker"): 1}
    api = KubernetesApi(tmp_path, deployments, role("scale", ["worker", "prefill-worker"]))
    with api.serving():
        account = api.service_account(NS, "planner")
        aggregated = KubernetesDeployments({"aggregated": "worker"}, credentials=account, environ=api.environment())
        assert aggregated.namespace == NS  # from the service account
        assert await aggregated.current(PoolSizes()) == PoolSizes(aggregated=3)
        assert await aggregated.scale(PoolSizes(aggregated=5)) == PoolSizes(aggregated=5)
        assert api.replicas[(NS, "worker")] == 5
        split = KubernetesDeployments(
            {"prefill": "prefill-worker", "decode": "worker"}, credentials=account, environ=api.environment()
        )
        assert await split.scale(PoolSizes(prefill=2, decode=4)) == PoolSizes(prefill=2, decode=4)
        assert await split.current(PoolSizes()) == PoolSizes(prefill=2, decode=4)
    patches = [c for c in api.calls if c.method == "PATCH"]
    assert [(c.deployment, c.body) for c in patches] == [
        ("worker", {"spec": {"replicas": 5}}),
        ("prefill-worker", {"spec": {"replicas": 2}}),
        ("worker", {"spec": {"replicas": 4}}),
    ]
    assert {c.user for c in api.calls} == {f"system:serviceaccount:{NS}:planner"}
    assert all(c.status == 200 for c in api.calls)


async def test_refusals_name_the_deployment_and_what_to_fix_and_change_nothing(tmp_path: Path):
    api = KubernetesApi(tmp_path, {(NS, "worker"): 2, (NS, "frontend"): 2}, role("scale", ["worker", "ghost"]))
    with api.serving():
        account = api.service_account(NS, "planner")
        env = api.environment()
        not_allowed = KubernetesDeployments({"aggregated": "frontend"}, credentials=account, environ=env)
        with pytest.raises(ConnectorError, match=r"may not PATCH deployments/frontend/scale .*rbac\.yaml"):
            await not_allowed.scale(PoolSizes(aggregated=9))
        missing = KubernetesDeployments({"aggregated": "ghost"}, credentials=account, environ=env)
        with pytest.raises(ConnectorError, match="no Deployment 'ghost' in namespace kvmesh"):
            await missing.current(PoolSizes())
        elsewhere = KubernetesDeployments({"aggregated": "worker"}, "other", credentials=account, environ=env)
        with pytest.raises(ConnectorError, match="may not GET"):
            await elsewhere.current(PoolSizes())
        (account / "token").write_text("revoked")  # read again on every call, as rotated tokens need
        with pytest.raises(ConnectorError, match="HTTP 401"):
            await KubernetesDeployments({"aggregated": "worker"}, credentials=account, environ=env).scale(
                PoolSizes(aggregated=7)
            )
        stranger = KubernetesApi(tmp_path / "other-cluster", {}, [])
        (account / "ca.crt").write_bytes((stranger.folder / "ca.pem").read_bytes())  # a CA that did not sign it
        with pytest.raises(ConnectorError, match="did not answer"):
            await KubernetesDeployments({"aggregated": "worker"}, credentials=account, environ=env).current(PoolSizes())
    assert api.replicas == {(NS, "worker"): 2, (NS, "frontend"): 2}
    with pytest.raises(ConnectorError, match="KUBERNETES_SERVICE_HOST"):
        KubernetesDeployments({"aggregated": "worker"}, credentials=account, environ={})
    with pytest.raises(ConnectorError, match="no service account token"):
        KubernetesDeployments({"aggregated": "worker"}, credentials=tmp_path / "nowhere", environ=env)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed")
async def test_the_planner_overlay_may_scale_its_workers_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from tests.kustomize import rendered

    objects = rendered("overlays/planner")
    [planner] = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "planner"]
    pod = planner["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[:2] == ["planner", "run"]
    config = service_config(PlannerConfig, args[2:])
    assert config.connector_name() == "kubernetes" and config.state_store == "nats"
    deployments = {(NS, o["metadata"]["name"]): 1 for o in objects if o["kind"] == "Deployment"}
    api = KubernetesApi(tmp_path, deployments, [o for o in objects if o["kind"] in ("Role", "RoleBinding")])
    account_name = pod["serviceAccountName"]
    assert any(o["kind"] == "ServiceAccount" and o["metadata"]["name"] == account_name for o in objects)
    with api.serving():
        config.kubernetes_credentials = api.service_account(NS, account_name)
        for key, value in api.environment().items():
            monkeypatch.setenv(key, value)
        connector = make_connector(config, nc=None)  # type: ignore[arg-type]  # this connector needs no NATS
        assert await connector.current(PoolSizes()) == PoolSizes(aggregated=1)
        assert await connector.scale(PoolSizes(aggregated=3)) == PoolSizes(aggregated=3)
    user = f"system:serviceaccount:{NS}:{account_name}"
    others = [name for (_ns, name) in deployments if name != config.kubernetes_deployment]
    assert others, "the overlay has other Deployments to keep out of reach"
    for name in others:
        assert not api.allowed(user, "patch", NS, name), f"the planner may scale {name}"
    assert api.replicas[(NS, "worker")] == 3
    # it marks the pod a shrink stops, and may do nothing else to pods
    assert config.kubernetes_departure_blocks > 0
    assert api.allowed(user, "patch", NS, "worker-7d9f-x2", group="", resource="pods")
    for verb in ("get", "list", "create", "delete", "update"):
        assert not api.allowed(user, verb, NS, "worker-7d9f-x2", group="", resource="pods"), verb
    [workers] = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "worker"]
    worker_pod = workers["spec"]["template"]["spec"]
    worker = service_config(WorkerConfig, worker_pod["containers"][0]["args"][1:])
    assert worker.shrink_handoff_blocks == config.kubernetes_departure_blocks  # the blocks it ranks by move
    env = {
        e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        for e in worker_pod["containers"][0]["env"]
    }
    assert env["KVMESH_POD_NAME"] == "metadata.name"


async def test_the_planner_service_sets_the_deployments_replicas_through_the_api(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    profile = tmp_path / "profile.json"
    profile_mock_engine(EngineConfig()).save(profile)
    api = KubernetesApi(tmp_path / "api", {(NS, "worker"): 0}, role("scale", ["worker"]))
    with api.serving():
        for key, value in api.environment().items():
            monkeypatch.setenv(key, value)
        config = service_config(
            PlannerConfig,
            [
                "--nats-url", nats_url,
                "--namespace", "k8s-planner",
                "--engine-profile", str(profile),
                "--connector", "kubernetes",
                "--kubernetes-credentials", str(api.service_account(NS, "planner")),
                "--state-store", "nats",
                "--min-workers", "2",
                "--adjustment-interval", "0.3",
                "--planner-lease-secs", "2",
                "--metrics-port", "-1",
            ],
        )  # fmt: skip
        async with running(serve, config):
            await wait_until_async(
                lambda: api.replicas[(NS, "worker")] == 2, timeout=30, what="the planner scales the Deployment"
            )
    assert any(c.method == "PATCH" and c.body == {"spec": {"replicas": 2}} for c in api.calls)
    assert all(c.status == 200 for c in api.calls), [c for c in api.calls if c.status != 200]


BLOCK = 16


def blocks_of(first_token: int, count: int) -> list[int]:
    return list(range(first_token, first_token + BLOCK * count))


@contextlib.asynccontextmanager
async def pods_of_mock_workers(nats_url: str, nc: NatsClient, namespace: str, pods: list[str]):
    """Mock workers, one per pod name, behind a router; yields (router address, {pod: record})."""
    common = ["--nats-url", nats_url, "--namespace", namespace]
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(running(indexer_server.serve, service_config(IndexerConfig, common)))
        for pod in pods:
            worker = service_config(WorkerConfig, [*common, "--speedup-ratio", "100", "--pod-name", pod])
            await stack.enter_async_context(running(worker_server.serve, worker))
        await stack.enter_async_context(running(router_server.serve, service_config(RouterConfig, common)))
        router = await up(nc, namespace, workers=len(pods), indexers=1)
        records = await registered(nc, namespace, "worker")
        yield router, {record.extra["pod"]: record for record in records}


async def test_a_shrink_marks_each_pod_with_what_its_departure_loses_and_the_cheapest_pod_goes(
    nats_url: str, nc: NatsClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Three worker pods: a holds a long prefix alone and shares one with b, b holds a short one alone,
    c a middling one. Before the shrink the planner marks each pod's deletion cost with the blocks
    only it holds (what the test reads from each worker's own dump), and the pod stopped is b."""
    pods = ["worker-a", "worker-b", "worker-c"]
    namespace = "k8s-departures"
    async with pods_of_mock_workers(nats_url, nc, namespace, pods) as (router, records):
        served = {
            "worker-a": [blocks_of(10_000, 40), blocks_of(20_000, 20)],
            "worker-b": [blocks_of(20_000, 20), blocks_of(30_000, 5)],
            "worker-c": [blocks_of(40_000, 10)],
        }
        for pod, prompts in served.items():
            for n, prompt in enumerate(prompts):
                await router_generate(router, f"{pod}-{n}", [*prompt, 1, 2, 3], 2, records[pod].instance_id)
        held = {pod: await cached_on(records[pod].address) for pod in pods}
        alone = {pod: len(held[pod] - set().union(*(held[o] for o in pods if o != pod))) for pod in pods}
        assert alone["worker-b"] < alone["worker-c"] < alone["worker-a"], alone  # the seeds took

        api = KubernetesApi(
            tmp_path / "api",
            {(NS, "worker"): 3},
            [*role("scale", ["worker"]), *pod_role()],
            pods={(NS, "worker"): list(pods)},
        )
        with api.serving():
            for key, value in api.environment().items():
                monkeypatch.setenv(key, value)
            config = planner_config(nats_url, namespace, api, "--kubernetes-departure-blocks", "4096")
            connector = make_connector(config, nc)
            assert await connector.scale(PoolSizes(aggregated=2)) == PoolSizes(aggregated=2)
            marks = [c for c in api.calls if c.body and "metadata" in c.body]
            assert await connector.scale(PoolSizes(aggregated=3)) == PoolSizes(aggregated=3)
        marked = {c.deployment: int(c.body["metadata"]["annotations"][DELETION_COST]) for c in marks}
        assert marked == alone and all(c.status == 200 for c in marks)
        assert api.deleted == ["worker-b"]  # the cheapest departure, by the ReplicaSet's documented rule
        assert [c for c in api.calls if c.body and "metadata" in c.body] == marks  # a grow marks nothing


async def test_without_leave_to_mark_pods_the_shrink_goes_ahead_and_the_replicaset_picks(
    nats_url: str, nc: NatsClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    pods = ["worker-a", "worker-b"]
    namespace = "k8s-departures-refused"
    async with pods_of_mock_workers(nats_url, nc, namespace, pods):
        api = KubernetesApi(
            tmp_path / "api", {(NS, "worker"): 2}, role("scale", ["worker"]), pods={(NS, "worker"): pods}
        )
        with api.serving():
            for key, value in api.environment().items():
                monkeypatch.setenv(key, value)
            connector = make_connector(
                planner_config(nats_url, namespace, api, "--kubernetes-departure-blocks", "64"), nc
            )
            assert await connector.scale(PoolSizes(aggregated=1)) == PoolSizes(aggregated=1)
    assert [c.status for c in api.calls if c.body and "metadata" in c.body] == [403]  # refused once, not retried
    assert api.annotations == {} and api.deleted == ["worker-b"]  # the newest: the ReplicaSet's own choice
    assert api.replicas[(NS, "worker")] == 1


def pod_role() -> list[dict[str, Any]]:
    """Leave to annotate the namespace's pods (their names are not known in advance)."""
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}
    return [
        {"kind": "Role", "metadata": {"name": "marks", "namespace": NS}, "rules": [rule]},
        {
            "kind": "RoleBinding",
            "metadata": {"name": "marks", "namespace": NS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "marks"},
            "subjects": [{"kind": "ServiceAccount", "name": "planner", "namespace": NS}],
        },
    ]


def planner_config(nats_url: str, namespace: str, api: KubernetesApi, *args: str) -> PlannerConfig:
    return service_config(
        PlannerConfig,
        [
            "--nats-url", nats_url,
            "--namespace", namespace,
            "--engine-profile", "unused.json",
            "--connector", "kubernetes",
            "--kubernetes-credentials", str(api.service_account(NS, "planner")),
            *args,
        ],
    )  # fmt: skip
