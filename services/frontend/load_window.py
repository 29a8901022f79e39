"""What this frontend served since its last load report, and the task that publishes the reports."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import structlog
from nats.aio.client import Client as NatsClient

from kvmesh.common.wire import names
from kvmesh.common.wire.frontend_load import LoadReport, RequestSample

log = structlog.get_logger(__name__)


class LoadWindow:
    """Counts arrivals and collects finished requests' samples until drained. Guarantees: each
    arrival and each sample is in exactly one report."""

    def __init__(self, source: str, clock: Callable[[], float] = time.time) -> None:
        self.source = source
        self._clock = clock
        self._start = clock()
        self._arrivals = 0
        self._samples: list[RequestSample] = []

    def arrived(self) -> None:
        self._arrivals += 1

    def finished(
        self, input_tokens: int, output_tokens: int, cached_tokens: int, ttft_s: float, decode_s: float
    ) -> None:
        """A request ended: ``decode_s`` is first token to last."""
        itl_ms = decode_s * 1000 / (output_tokens - 1) if output_tokens > 1 else math.nan
        self._samples.append(RequestSample(input_tokens, output_tokens, cached_tokens, ttft_s * 1000, itl_ms))

    def drain(self) -> LoadReport:
        now = self._clock()
        report = LoadReport(self.source, self._start, now, self._arrivals, tuple(self._samples))
        self._start, self._arrivals, self._samples = now, 0, []
        return report


async def publish_load_forever(nc: NatsClient, namespace: str, window: LoadWindow, period_s: float) -> None:
    """Publish the window every ``period_s`` (an empty one too: the planner sees an idle frontend)."""
    subject = names.load_report_subject(namespace)
    while True:
        await asyncio.sleep(period_s)
        report = window.drain()
        try:
            await nc.publish(subject, report.encode())
        except Exception as exc:  # NATS down for a moment: this report is lost, the next one is not
            log.warning("load report not published", error=str(exc), requests=len(report.samples))
