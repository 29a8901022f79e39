"""Misconfigurations a service has found in the mesh around it, said loudly and once.

A misconfigured mesh usually still serves (a worker whose KV events never arrive is routed on load
alone), so nothing fails and an operator would have to read the logs line by line to learn of it.
Each finding here is logged once as a warning that says what to change, counted in the gauge
``kvmesh_misconfigurations{kind}`` of the service's registry, and listed for ``kvmesh inspect``;
when it goes away, that is logged once too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Gauge

log = structlog.get_logger(__name__)


class Findings:
    """Guarantees: a finding (kind, key) is logged when it is first found and when it is resolved,
    never in between however often it is found again; the gauge counts the open ones per kind."""

    def __init__(self, registry: CollectorRegistry | None = None, logger: Any = None) -> None:
        """``logger``: where findings are said (this module's structlog logger by default)."""
        self._log = logger if logger is not None else log
        self._open: dict[tuple[str, str], str] = {}
        self._gauge = (
            Gauge(
                "kvmesh_misconfigurations",
                "misconfigurations this service has found and that still hold, by kind (its log and kvmesh inspect "
                "say what to change)",
                ["kind"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    def found(self, kind: str, key: str, message: str) -> None:
        """``message``: what is wrong and what to change, in one sentence or two."""
        if (kind, key) in self._open:
            self._open[(kind, key)] = message  # its figures may have changed; said once all the same
            return
        self._open[(kind, key)] = message
        self._log.warning("misconfiguration", kind=kind, problem=message)
        self._count(kind)

    def resolved(self, kind: str, key: str) -> None:
        if self._open.pop((kind, key), None) is not None:
            self._log.info("misconfiguration resolved", kind=kind, key=key)
            self._count(kind)

    def keep_only(self, kind: str, keys: Iterable[str]) -> None:
        """Resolve every open finding of ``kind`` but those of ``keys``."""
        keep = set(keys)
        for open_kind, key in list(self._open):
            if open_kind == kind and key not in keep:
                self.resolved(kind, key)

    def messages(self) -> list[str]:
        """The open findings' messages, in the order they were found."""
        return list(self._open.values())

    def keys(self, kind: str) -> set[str]:
        """The keys of the open findings of ``kind``."""
        return {key for open_kind, key in self._open if open_kind == kind}

    def _count(self, kind: str) -> None:
        if self._gauge is not None:
            self._gauge.labels(kind).set(sum(1 for k, _ in self._open if k == kind))
