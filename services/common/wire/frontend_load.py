"""What a frontend served in a few seconds, published for the planner (msgpack on core NATS).

The frontend counts arrivals and, per finished request, its prompt, output and cached tokens, its
TTFT and mean inter-token latency; the planner merges every frontend's reports over its adjustment
interval into one observation. Samples, not percentiles, travel: percentiles of several frontends
cannot be merged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack

VERSION = 1


class LoadReportError(ValueError):
    """A message on the load subject that is not a load report this version reads."""


@dataclass(frozen=True)
class RequestSample:
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    ttft_ms: float
    itl_ms: float  # mean over the request; NaN with fewer than two tokens


@dataclass(frozen=True)
class LoadReport:
    source: str  # the frontend's id
    start_s: float  # wall-clock window of the report
    end_s: float
    arrivals: int
    samples: tuple[RequestSample, ...] = field(default_factory=tuple)

    def encode(self) -> bytes:
        rows = [
            [s.input_tokens, s.output_tokens, s.cached_tokens, s.ttft_ms, None if math.isnan(s.itl_ms) else s.itl_ms]
            for s in self.samples
        ]
        return msgpack.packb([VERSION, self.source, self.start_s, self.end_s, self.arrivals, rows])

    @classmethod
    def decode(cls, data: bytes) -> LoadReport:
        try:
            version, source, start, end, arrivals, rows = msgpack.unpackb(data)
            if version != VERSION:
                raise LoadReportError(f"load report version {version}, expected {VERSION}")
            samples = tuple(
                RequestSample(int(i), int(o), int(c), float(t), math.nan if itl is None else float(itl))
                for i, o, c, t, itl in rows
            )
            return cls(str(source), float(start), float(end), int(arrivals), samples)
        except LoadReportError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise LoadReportError(f"not a load report: {exc}") from exc
