"""Where a gateway of the Gateway API Inference Extension sends a worker's requests: the address of
the worker's model server (``host:port`` of its OpenAI HTTP API), advertised in the worker's
discovery record under :data:`GATEWAY_ENDPOINT_KEY`. The endpoint picker
(:mod:`kvmesh.frontend.endpoint_picker`) names it in :data:`DESTINATION_HEADER`."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

GATEWAY_ENDPOINT_KEY = "gateway_endpoint"
# The header and dynamic-metadata key the extension's endpoint picker protocol names, and the
# metadata namespace the gateway's load balancer reads it from.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"


def endpoint_of_url(url: str) -> str:
    """``host:port`` of an http(s) URL (the port its scheme implies when it names none)."""
    parts = urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"{url!r} names no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


def gateway_endpoint(extra: Mapping[str, object]) -> str | None:
    """The endpoint a worker's discovery record advertises, if any."""
    value = extra.get(GATEWAY_ENDPOINT_KEY)
    return value if isinstance(value, str) and value else None
