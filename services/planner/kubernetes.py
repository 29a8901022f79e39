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
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from kvmesh.planner.connector import ConnectorError, by_pool
from kvmesh.planner.decision import PoolSizes

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_TIMEOUT_S = 10.0


class KubernetesDeployments:
    """Scales Deployments, one per pool (``{"aggregated": "worker"}``, or ``{"prefill":
    "prefill-worker", "decode": "worker"}``), in one namespace."""

    def __init__(
        self,
        deployments: Mapping[str, str],
        namespace: str = "",
        credentials: Path = SERVICE_ACCOUNT_DIR,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.deployments = by_pool(deployments, "deployments")
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

    def _url(self, deployment: str) -> str:
        return f"{self.api}/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}/scale"

    async def _call(self, method: str, deployment: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        token = (self.credentials / "token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        content = None
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
            content = json.dumps(body).encode()
        what = f"deployments/{deployment}/scale in namespace {self.namespace}"
        try:
            async with httpx.AsyncClient(verify=self._tls, timeout=REQUEST_TIMEOUT_S) as client:
                response = await client.request(method, self._url(deployment), headers=headers, content=content)
        except httpx.HTTPError as exc:
            raise ConnectorError(f"the Kubernetes API at {self.api} did not answer ({what}): {exc}") from exc
        if response.status_code == 404:
            raise ConnectorError(f"no Deployment {deployment!r} in namespace {self.namespace} ({method} {what})")
        if response.status_code in (401, 403):
            raise ConnectorError(
                f"the planner's service account may not {method} {what} (HTTP {response.status_code}): its Role "
                "must allow get and patch on deployments/scale of the pools' Deployments "
                "(deploy/k8s/overlays/planner/rbac.yaml)"
            )
        if response.status_code >= 400:
            raise ConnectorError(f"{method} {what}: HTTP {response.status_code}: {response.text[:300]}")
        try:
            return response.json()
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
            patch = {"spec": {"replicas": getattr(target, pool)}}
            sizes[pool] = self._replicas(await self._call("PATCH", deployment, patch), "spec")
        return PoolSizes(**sizes)
