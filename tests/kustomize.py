"""deploy/k8s as `kubectl kustomize` renders it, and a container's environment as Kubernetes builds
it: what the manifest tests and the overlay boot test both read."""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"


@functools.cache
def rendered(kustomization: str) -> list[dict[str, Any]]:
    """The objects ``deploy/k8s/<kustomization>`` renders to (cached: read them, do not change them)."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / kustomization)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in an argument or env value (an unknown name stays as written)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def container_env(
    objects: list[dict[str, Any]],
    container: dict[str, Any],
    fields: Mapping[str, str],
    secret: Callable[[dict[str, str]], str],
) -> dict[str, str]:
    """The container's environment: its ConfigMaps, then ``env`` in order, each value's ``$(VAR)``
    expanded from what came before. ``fields``: what the downward API gives (by field path);
    ``secret``: the value of a ``secretKeyRef`` (given the reference)."""
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = secret(var["valueFrom"]["secretKeyRef"])
        else:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env
