"""``--connector kubernetes``: each pool is one Deployment, resized through its ``scale``
subresource on the Kubernetes API, from inside the cluster (docs/decisions/0050).

The planner runs in a pod whose service account may ``get`` and ``patch`` ``deployments/scale`` of
exactly the pools' Deployments (``deploy/k8s/overlays/planner/rbac.yaml``). It reaches the API server
as every in-cluster client does: ``$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` over TLS,
trusting the service account's ``ca.crt`` and presenting its ``token`` (read again on each call:
Kubernetes rotates bound tokens); the namespace is the service account's unless named.

A pool's size is its Deployment's pods (the scale's ``status.replicas``). :meth:`KubernetesDeployments.scale`
sets ``spec.replicas`` with a JSON merge patch and returns the sizes the API server accepted; the
Deployment controller then starts or stops pods, and a stopped kvmesh worker gets SIGTERM,
deregisters at once and finishes its streams within the pod's grace period, so no request is lost.
Errors (no such Deployment, a role that does not allow it, an API server that does not answer) raise
:class:`ConnectorError` naming the Deployment and what to fix.

Which pod a shrink stops is the ReplicaSet's choice; among running, ready pods it stops those with
the lowest ``controller.kubernetes.io/pod-deletion-cost`` first. Given ``departures`` (the planner's
``--kubernetes-departure-blocks``), a shrink first marks each of the pool's pods with what its
departure loses (:func:`kvmesh.common.calling.worker_caches.departure_costs`), so the pod stopped is
the one that loses least (docs/decisions/0050, 0051); that needs ``patch`` on ``pods``. A mark that
cannot be set is logged and the shrink goes ahead with the ReplicaSet's own choice.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import structlog

from kvmesh.planner.connector import ConnectorError, by_pool
from kvmesh.planner.decision import PoolSizes

log = structlog.get_logger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_TIMEOUT_S = 10.0
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
SCALE_ROLE = "get and patch on deployments/scale of the pools' Deployments"
POD_ROLE = "patch on pods"

# A pool's pods and what each one's departure loses: {pod name: cost}.
Departures = Callable[[str], Awaitable[Mapping[str, int]]]


class KubernetesDeployments:
    """Scales Deployments, one per pool (``{"aggregated": "worker"}``, or ``{"prefill":
    "prefill-worker", "decode": "worker"}``), in one namespace."""

    def __init__(
        self,
        deployments: Mapping[str, str],
        namespace: str = "",
        credentials: Path = SERVICE_ACCOUNT_DIR,
        environ: Mapping[str, str] | None = None,
        departures: Departures | None = None,
    ) -> None:
        self.deployments = by_pool(deployments, "deployments")
        self.departures = departures
        environ = os.environ if environ is None else environ
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ConnectorError(
                "--connector kubernetes runs inside a Kubernetes pod: KUBERNETES_SERVICE_HOST and "
                "KUBERNETES_SERVICE_PORT are not set"
            )
        self.credentials = credentials
        for needed in ("token", "ca.crt"):
            if not (credentials / needed).is_file():
                raise ConnectorError(
                    f"--connector kubernetes: no service account {needed} in {credentials} (is the pod's "
                    "service account token mounted? automountServiceAccountToken must not be false)"
                )
        if not namespace:
            try:
                namespace = (credentials / "namespace").read_text().strip()
            except OSError as exc:
                raise ConnectorError(f"--kubernetes-namespace is not set and {credentials}/namespace: {exc}") from exc
        self.namespace = namespace
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        self.api = f"https://{host}:{port}"
        self._tls = ssl.create_default_context(cafile=str(credentials / "ca.crt"))

    def _scale_path(self, deployment: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}/scale"

    async def _call(self, method: str, deployment: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        what = f"deployments/{deployment}/scale in namespace {self.namespace}"
        status, answer = await self._request(method, self._scale_path(deployment), what, SCALE_ROLE, body)
        if status == 404:
            raise ConnectorError(f"no Deployment {deployment!r} in namespace {self.namespace} ({method} {what})")
        return answer

    async def _request(
        self, method: str, path: str, what: str, role: str, body: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """(HTTP status, the JSON answer) of one call; 404 is the caller's to explain, every other
        refusal raises :class:`ConnectorError` naming ``what`` and, where the Role falls short, ``role``."""
        token = (self.credentials / "token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        content = None
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
            content = json.dumps(body).encode()
        try:
            async with httpx.AsyncClient(verify=self._tls, timeout=REQUEST_TIMEOUT_S) as client:
                response = await client.request(method, f"{self.api}{path}", headers=headers, content=content)
        except httpx.HTTPError as exc:
            raise ConnectorError(f"the Kubernetes API at {self.api} did not answer ({what}): {exc}") from exc
        if response.status_code in (401, 403):
            raise ConnectorError(
                f"the planner's service account may not {method} {what} (HTTP {response.status_code}): its Role "
                f"must allow {role} (deploy/k8s/overlays/planner/rbac.yaml)"
            )
        if response.status_code >= 400 and response.status_code != 404:
            raise ConnectorError(f"{method} {what}: HTTP {response.status_code}: {response.text[:300]}")
        try:
            return response.status_code, response.json()
        except ValueError as exc:
            raise ConnectorError(f"{method} {what}: not JSON: {response.text[:200]!r}") from exc

    @staticmethod
    def _replicas(scale: dict[str, Any], part: str) -> int:
        try:
            return int((scale.get(part) or {}).get("replicas") or 0)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConnectorError(f"a Scale without a replica count in {part}: {str(scale)[:200]}") from exc

    async def current(self, registered: PoolSizes) -> PoolSizes:
        sizes = {pool: self._replicas(await self._call("GET", d), "status") for pool, d in self.deployments.items()}
        return PoolSizes(**sizes)

    async def scale(self, target: PoolSizes) -> PoolSizes:
        sizes = {}
        for pool, deployment in self.deployments.items():
            wanted = getattr(target, pool)
            if self.departures is not None and wanted < self._replicas(await self._call("GET", deployment), "spec"):
                await self._mark_departures(pool)
            patch = {"spec": {"replicas": wanted}}
            sizes[pool] = self._replicas(await self._call("PATCH", deployment, patch), "spec")
        return PoolSizes(**sizes)

    async def _mark_departures(self, pool: str) -> None:
        """Set each of ``pool``'s pods' deletion cost to what its departure loses, before a shrink."""
        assert self.departures is not None
        try:
            costs = await self.departures(pool)
            for pod, cost in costs.items():
                what = f"pods/{pod} in namespace {self.namespace}"
                patch = {"metadata": {"annotations": {DELETION_COST: str(cost)}}}
                path = f"/api/v1/namespaces/{self.namespace}/pods/{pod}"
                status, _ = await self._request("PATCH", path, what, POD_ROLE, patch)
                if status == 404:
                    log.info("a pod to mark is gone", pod=pod)
        except ConnectorError as exc:
            log.warning("cannot mark which pod a shrink should stop; the ReplicaSet picks", error=str(exc))
            return
        log.info("marked which pod a shrink stops first", pool=pool, deletion_costs=dict(costs))
