"""The reports of the callers (frontends) that stream requests straight from the workers this replica
chose for them, which arrive on their ``RouteMany`` streams (docs/decisions/0023)."""

from __future__ import annotations

import structlog

from kvmesh.common.wire.request_reports import END, FIRST_TOKEN, RequestReport, decode_reports
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.routing import Router

log = structlog.get_logger(__name__)

MIGRATED = "migrated"  # an END whose try broke and moved on: the request itself goes on elsewhere


class ReportListener:
    """Applies each report to the load picture: the first token marks the prefill done; the end
    frees the request, avoids a worker whose stream broke and counts the outcome (or the migration).
    Guarantees: a report for a request this replica does not hold (already freed, expired, freed
    with its departed worker, or never routed here) changes no load, so a repeated or late report
    cannot free another request's."""

    def __init__(self, router: Router, metrics: RouterMetrics) -> None:
        self._router = router
        self._metrics = metrics
        self.applied = 0

    def apply_message(self, payload: bytes) -> list[RequestReport]:
        """The reports of one ``RouteMany`` message (:mod:`kvmesh.common.wire.request_reports`); returns
        them (none when the message is malformed: it is ignored whole)."""
        try:
            reports = decode_reports(payload)
        except ValueError as exc:
            log.warning("ignoring malformed request reports", error=str(exc))
            return []
        for report in reports:
            self.apply(report)
        return reports

    def apply(self, report: RequestReport) -> None:
        router = self._router
        if report.kind == END:
            # counted even when the request is no longer held (its worker left, which frees them)
            if report.failed_worker_id:
                router.avoid(report.failed_worker_id)
            if report.outcome == MIGRATED:
                self._metrics.migrated()
            elif report.outcome:
                self._metrics.outcome(report.outcome)
        if report.request_id not in router.loads:
            return
        self.applied += 1
        if report.kind == FIRST_TOKEN:
            router.picture.first_token(report.request_id)
        else:
            router.picture.free(report.request_id, report.output_tokens)
