"""What a frontend streaming straight from a worker tells the router that routed the request
(docs/decisions/0023): the first token, and the end of each try.

A msgpack list of report maps per message (the reports of a few milliseconds, batched), in the
``reports`` field of the frontend's next ``RouteMany`` message to the replica that routed them.
The router applies them to its load picture exactly as it would had it relayed the stream itself
(MarkPrefillCompleted, Free) and passes them to its replicas through replica sync as usual; a report
that is lost leaves the request to ``--request-timeout-secs``, like a lost Free.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

FIRST_TOKEN, END = "first_token", "end"
KINDS = (FIRST_TOKEN, END)


@dataclass(frozen=True)
class RequestReport:
    kind: str  # FIRST_TOKEN or END
    request_id: str
    # END only: how the try ended, named like the router's outcomes (completed, cancelled, migrated,
    # unavailable, ...), the tokens it produced, and the worker whose stream broke (0: none did)
    outcome: str = ""
    output_tokens: int = 0
    failed_worker_id: int = 0
    # FIRST_TOKEN of a split request only: the decode worker's KvSource (kvmesh.common.wire.disagg), where
    # the prompt's KV came from, for the router's prefill counts
    kv_source: bytes = b""

    def as_map(self) -> dict[str, object]:
        raw: dict[str, object] = {
            "kind": self.kind,
            "request_id": self.request_id,
            "outcome": self.outcome,
            "output_tokens": self.output_tokens,
            "failed_worker_id": self.failed_worker_id,
        }
        if self.kv_source:
            raw["kv_source"] = self.kv_source
        return raw

    @classmethod
    def from_map(cls, raw: dict) -> RequestReport:
        """Raises ``ValueError`` for anything but a report of a known kind."""
        try:
            report = cls(
                kind=str(raw["kind"]),
                request_id=str(raw["request_id"]),
                outcome=str(raw.get("outcome", "")),
                output_tokens=int(raw.get("output_tokens", 0)),
                failed_worker_id=int(raw.get("failed_worker_id", 0)),
                kv_source=raw.get("kv_source", b""),
            )
        except Exception as exc:
            raise ValueError(f"not a request report: {exc}") from exc
        if not isinstance(report.kv_source, bytes):
            raise ValueError(f"not a request report: kv_source is {type(report.kv_source).__name__}")
        if report.kind not in KINDS or not report.request_id:
            raise ValueError(f"not a request report: kind {report.kind!r}, request_id {report.request_id!r}")
        return report


def without_superseded(reports: list[RequestReport]) -> list[RequestReport]:
    """``reports`` less each first-token report whose request's end is among them: the end frees the
    request, which leaves nothing for marking its prefill done to change (one that carries a
    ``kv_source`` stays: the router counts it). At low load a short answer's two reports nearly
    always leave together, with the client's next request."""
    ended = {r.request_id for r in reports if r.kind == END}
    if not ended:
        return reports
    return [r for r in reports if r.kind != FIRST_TOKEN or r.kv_source or r.request_id not in ended]


def encode_reports(reports: list[RequestReport]) -> bytes:
    return msgpack.packb([r.as_map() for r in reports])


def decode_reports(payload: bytes) -> list[RequestReport]:
    """Raises ``ValueError`` when the message is not a list of reports (a bad one spoils the lot)."""
    try:
        raw = msgpack.unpackb(payload)
    except Exception as exc:
        raise ValueError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list):
        raise ValueError(f"not a list of request reports but {type(raw).__name__}")
    return [RequestReport.from_map(item) for item in raw]
