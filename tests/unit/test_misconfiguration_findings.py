"""Findings (kvmesh.common.runtime.misconfiguration): said once when found, once when resolved."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvmesh.common.runtime.misconfiguration import Findings


class Said:
    """A logger that keeps what it was told."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append({"event": event, "level": "warning", **fields})

    def info(self, event: str, **fields) -> None:
        self.lines.append({"event": event, "level": "info", **fields})


def test_a_finding_is_logged_once_however_often_it_is_found_and_once_when_resolved():
    registry = CollectorRegistry()
    said = Said()
    findings = Findings(registry, said)
    for _ in range(3):
        findings.found("block_sizes", "m", "the workers of model 'm' have different KV block sizes")
    findings.found("block_sizes", "n", "the workers of model 'n' have different KV block sizes")
    assert registry.get_sample_value("kvmesh_misconfigurations", {"kind": "block_sizes"}) == 2
    findings.keep_only("block_sizes", ["n"])
    findings.keep_only("block_sizes", ["n"])
    assert [(entry["event"], entry.get("kind")) for entry in said.lines] == [
        ("misconfiguration", "block_sizes"),
        ("misconfiguration", "block_sizes"),
        ("misconfiguration resolved", "block_sizes"),
    ]
    assert findings.messages() == ["the workers of model 'n' have different KV block sizes"]
    assert registry.get_sample_value("kvmesh_misconfigurations", {"kind": "block_sizes"}) == 1
