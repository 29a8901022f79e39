"""A stand-in for the part of the Kubernetes API the planner's ``kubernetes`` connector calls: the
``scale`` subresource of Deployments (GET, and PATCH with a JSON merge patch) and a pod's
annotations (PATCH), over HTTPS, with service-account bearer tokens authenticated and every call
authorized by the RBAC Roles bound to the caller, as the API server's RBAC authorizer does. No
cluster can run here (no kubelet, no container runtime for pods), so this is the API's contract, not
its implementation: what it checks is what kubernetes.io documents for these calls. Of the
controllers, one documented rule is modelled: a scale's ``status.replicas`` follows ``spec.replicas``
at once, and where a Deployment's pods are named, a scale-down deletes the pods with the lowest
``controller.kubernetes.io/pod-deletion-cost`` first (all of them running and ready; ties: the newest)."""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.certificates import make_certificates

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([a-z0-9.-]+)/deployments/([a-z0-9.-]+)/scale$")
POD_PATH = re.compile(r"^/api/v1/namespaces/([a-z0-9.-]+)/pods/([a-z0-9.-]+)$")
VERBS = {"GET": "get", "PATCH": "patch"}
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class Call:
    method: str
    namespace: str
    deployment: str
    user: str  # system:serviceaccount:<namespace>:<name>, or "" for an unknown token
    status: int
    body: Any = None


class KubernetesApi:
    """Deployments' replica counts by (namespace, name), optionally their pods (oldest first), and
    the RBAC objects (Role, RoleBinding) that decide who may do what with them. ``calls`` lists every
    request, in order; ``deleted`` the pods scale-downs removed."""

    def __init__(
        self,
        folder: Path,
        deployments: dict[tuple[str, str], int],
        rbac: list[dict[str, Any]],
        pods: dict[tuple[str, str], list[str]] | None = None,
    ) -> None:
        self.folder = folder
        self.replicas = dict(deployments)
        self.rbac = rbac
        self.pods = {key: list(names) for key, names in (pods or {}).items()}
        for key, names in self.pods.items():
            assert len(names) == self.replicas[key], "a Deployment's pods are its replicas"
        self.annotations: dict[tuple[str, str], dict[str, str]] = {}  # (namespace, pod) -> annotations
        self.deleted: list[str] = []
        self._started = 0
        self.tokens: dict[str, str] = {}  # token -> user
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)
        self._certificates = make_certificates(folder)
        self._server: ThreadingHTTPServer | None = None

    # --- what a pod of a service account is given ---------------------------------------------
    def service_account(self, namespace: str, name: str) -> Path:
        """The folder Kubernetes mounts at /var/run/secrets/kubernetes.io/serviceaccount for a pod of
        this service account: its token, the cluster's CA and its namespace."""
        token = secrets.token_hex(16)
        self.tokens[token] = f"system:serviceaccount:{namespace}:{name}"
        mount = self.folder / f"sa-{namespace}-{name}-{len(self.tokens)}"
        mount.mkdir()
        (mount / "token").write_text(token)
        shutil.copy(self._certificates["ca"], mount / "ca.crt")
        (mount / "namespace").write_text(namespace)
        return mount

    def environment(self) -> dict[str, str]:
        assert self._server is not None
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self._server.server_port)}

    # --- RBAC ----------------------------------------------------------------------------------
    def allowed(
        self, user: str, verb: str, namespace: str, name: str, group: str = "apps", resource: str = "deployments/scale"
    ) -> bool:
        roles = set()
        for binding in (o for o in self.rbac if o["kind"] == "RoleBinding"):
            if binding["metadata"].get("namespace") != namespace or binding["roleRef"]["kind"] != "Role":
                continue
            for subject in binding.get("subjects", []):
                who = f"system:serviceaccount:{subject.get('namespace', namespace)}:{subject['name']}"
                if subject["kind"] == "ServiceAccount" and who == user:
                    roles.add(binding["roleRef"]["name"])
        for role in (o for o in self.rbac if o["kind"] == "Role"):
            if role["metadata"]["name"] not in roles or role["metadata"].get("namespace") != namespace:
                continue
            for rule in role.get("rules", []):
                if (
                    {group, "*"} & set(rule.get("apiGroups", []))
                    and {resource, "*"} & set(rule.get("resources", []))
                    and {verb, "*"} & set(rule.get("verbs", []))
                    and (not rule.get("resourceNames") or name in rule["resourceNames"])
                ):
                    return True
        return False

    # --- the server ----------------------------------------------------------------------------
    def scale(self, namespace: str, deployment: str) -> dict[str, Any]:
        replicas = self.replicas[(namespace, deployment)]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {"name": deployment, "namespace": namespace},
            "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "selector": f"app.kubernetes.io/name={deployment}"},
        }

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """The API's answer to one request, recorded in :attr:`calls`."""
        user = self.tokens.get(headers.get("authorization", "").removeprefix("Bearer ").strip(), "")
        pod = POD_PATH.match(path)
        if pod:
            namespace, deployment = pod.groups()  # a pod's name, in the record's deployment column
            status, answer = self._patch_pod(method, namespace, deployment, user, headers, body)
            self.calls.append(Call(method, namespace, deployment, user, status, json.loads(body) if body else None))
            return status, answer
        match = SCALE_PATH.match(path)
        namespace, deployment = match.groups() if match else ("", "")
        status, answer = self._decide(method, path, match is not None, namespace, deployment, user, headers, body)
        self.calls.append(Call(method, namespace, deployment, user, status, json.loads(body) if body else None))
        return status, answer

    def _decide(
        self,
        method: str,
        path: str,
        matched: bool,
        namespace: str,
        deployment: str,
        user: str,
        headers: dict[str, str],
        body: bytes,
    ) -> tuple[int, dict[str, Any]]:
        if not user:
            return 401, {"kind": "Status", "reason": "Unauthorized"}
        if not matched or method not in VERBS:
            return 404, {"kind": "Status", "reason": "NotFound"}
        if not self.allowed(user, VERBS[method], namespace, deployment):
            return 403, {"kind": "Status", "reason": "Forbidden", "message": f"{user} cannot {method} {path}"}
        if (namespace, deployment) not in self.replicas:
            return 404, {"kind": "Status", "reason": "NotFound"}
        if method == "PATCH":
            if headers.get("content-type") != "application/merge-patch+json":
                return 415, {"kind": "Status", "reason": "UnsupportedMediaType"}
            try:
                replicas = json.loads(body)["spec"]["replicas"]
            except (ValueError, KeyError, TypeError):
                return 422, {"kind": "Status", "reason": "Invalid"}
            if not isinstance(replicas, int) or replicas < 0:
                return 422, {"kind": "Status", "reason": "Invalid"}
            self._resize(namespace, deployment, replicas)
        return 200, self.scale(namespace, deployment)

    def _resize(self, namespace: str, deployment: str, replicas: int) -> None:
        self.replicas[(namespace, deployment)] = replicas
        pods = self.pods.get((namespace, deployment))
        if pods is None:
            return
        while len(pods) > replicas:  # the lowest deletion cost first; of equal ones, the newest
            costs = [int(self.annotations.get((namespace, p), {}).get(DELETION_COST, "0")) for p in pods]
            lowest = min(costs)
            gone = pods.pop(max(i for i, c in enumerate(costs) if c == lowest))
            self.annotations.pop((namespace, gone), None)
            self.deleted.append(gone)
        while len(pods) < replicas:
            self._started += 1
            pods.append(f"{deployment}-started-{self._started}")

    def _patch_pod(
        self, method: str, namespace: str, pod: str, user: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, Any]]:
        if not user:
            return 401, {"kind": "Status", "reason": "Unauthorized"}
        if method != "PATCH":
            return 404, {"kind": "Status", "reason": "NotFound"}
        if not self.allowed(user, "patch", namespace, pod, group="", resource="pods"):
            return 403, {"kind": "Status", "reason": "Forbidden", "message": f"{user} cannot patch pods/{pod}"}
        if not any(pod in pods for (ns, _), pods in self.pods.items() if ns == namespace):
            return 404, {"kind": "Status", "reason": "NotFound"}
        if headers.get("content-type") != "application/merge-patch+json":
            return 415, {"kind": "Status", "reason": "UnsupportedMediaType"}
        try:
            annotations = json.loads(body)["metadata"]["annotations"]
            assert isinstance(annotations, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            return 422, {"kind": "Status", "reason": "Invalid"}
        if DELETION_COST in annotations:
            try:
                int(annotations[DELETION_COST])  # an int32, in a string
            except (TypeError, ValueError):
                return 422, {"kind": "Status", "reason": "Invalid", "message": f"{DELETION_COST} must be an integer"}
        held = self.annotations.setdefault((namespace, pod), {})
        for key, value in annotations.items():  # a merge patch: null removes
            if value is None:
                held.pop(key, None)
            else:
                held[key] = value
        return 200, {"kind": "Pod", "metadata": {"name": pod, "namespace": namespace, "annotations": held}}

    @contextlib.contextmanager
    def serving(self) -> Iterator[KubernetesApi]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                with api._lock:
                    status, answer = api.handle(self.command, self.path, headers, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = _answer

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(self._certificates["server_cert"], self._certificates["server_key"])
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        self._server = server
        thread = threading.Thread(target=server.serve_forever, name="kubernetes-api", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
