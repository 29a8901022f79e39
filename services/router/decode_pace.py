"""Each worker's recent decode pace: the mean inter-token latency of the requests that ended there.

The router sees a request's first token and its end (the callers' reports; in ``kvmesh replay`` the
simulated engine's), and the end says how many tokens it produced: (end − first token) ÷ (tokens −
1) is the request's mean inter-token latency, the quantity an ITL target is kept on. Kept per
worker for ``WINDOW_S``, they tell a worker whose decodes miss the target from one whose do not
(:meth:`DecodePace.behind`), which no prediction did: the step-time model's mean ITL under-predicts
a worker whose long contexts share steps with other sessions' prefill chunks (docs/decisions/0067).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvmesh.common.wire.worker_key import WorkerKey

WINDOW_S = 20.0  # how long an ended request counts: a few intervals of a planner, many requests
MIN_REQUESTS = 10  # fewer say too little of a share of misses
BEHIND_SHARE = 0.10  # a worker with more than this share of its recent requests past the target is behind
ON_PACE_SHARE = 0.02  # ... while another candidate has at most this share (or too few requests to tell)
BEHIND_PENALTY_MS = 500.0  # what a behind worker is charged for a new session's first turn


class DecodePace:
    """Guarantees: a worker's samples are the requests that ended there within ``WINDOW_S`` of the
    latest asked-about time; memory is bounded by the requests of one window; a departed worker's
    samples go with it (:meth:`forget`); a share is read in constant time while the target asked
    about stays the same (the misses are counted as samples come and go)."""

    def __init__(self) -> None:
        self._ended: dict[WorkerKey, deque[tuple[float, float]]] = {}  # worker -> (ended at, mean ITL ms)
        # the samples past ``_target_ms`` per worker, kept as they come and go: read for every candidate
        # of a session's first turn, a sum over each window cost 2.7 ms at 256 workers of 78 samples
        self._target_ms: float | None = None
        self._missed: dict[WorkerKey, int] = {}

    def ended(self, worker: WorkerKey, now: float, itl_ms: float) -> None:
        """A request on ``worker`` ended at ``now`` (seconds) after a mean inter-token latency of ``itl_ms``."""
        samples = self._ended.setdefault(worker, deque())
        samples.append((now, itl_ms))
        if self._target_ms is not None and itl_ms > self._target_ms:
            self._missed[worker] = self._missed.get(worker, 0) + 1
        self._drop_old(worker, samples, now)

    def forget(self, worker_id: int) -> None:
        """A worker left: its ranks' samples go."""
        for key in [key for key in self._ended if key[0] == worker_id]:
            del self._ended[key]
            self._missed.pop(key, None)

    def missed_share(self, worker: WorkerKey, now: float, target_ms: float) -> float | None:
        """The share of ``worker``'s requests ended within the window whose mean ITL passed
        ``target_ms`` (None: fewer than ``MIN_REQUESTS`` to tell)."""
        samples = self._ended.get(worker)
        if not samples:
            return None
        if target_ms != self._target_ms:
            self._count_past(target_ms)
        self._drop_old(worker, samples, now)
        if len(samples) < MIN_REQUESTS:
            return None
        return self._missed.get(worker, 0) / len(samples)

    def behind(self, workers: Sequence[WorkerKey], now: float, target_ms: float) -> list[float] | None:
        """Per candidate, ``BEHIND_PENALTY_MS`` where its decodes are behind ``target_ms`` (more than
        ``BEHIND_SHARE`` of its recent requests missed it) while another candidate's are on pace (at
        most ``ON_PACE_SHARE``, or too few requests to tell: a worker just joined), else 0; None when
        no candidate is behind or none is on pace.

        Why both: where every worker misses (a fleet short of decode capacity) another placement
        helps nobody, and one worker missing among others that do not is what a new placement can
        fix."""
        if not self._ended:
            return None
        shares = [self.missed_share(worker, now, target_ms) for worker in workers]
        if not any(share is not None and share > BEHIND_SHARE for share in shares):
            return None
        if not any(share is None or share <= ON_PACE_SHARE for share in shares):
            return None
        return [BEHIND_PENALTY_MS if share is not None and share > BEHIND_SHARE else 0.0 for share in shares]

    def _count_past(self, target_ms: float) -> None:
        """Count every worker's samples past ``target_ms`` afresh (a target not asked about before)."""
        self._target_ms = target_ms
        self._missed = {
            worker: sum(1 for _, itl in samples if itl > target_ms) for worker, samples in self._ended.items()
        }

    def _drop_old(self, worker: WorkerKey, samples: deque[tuple[float, float]], now: float) -> None:
        target = self._target_ms
        while samples and samples[0][0] < now - WINDOW_S:
            _, itl = samples.popleft()
            if target is not None and itl > target:
                self._missed[worker] -= 1
