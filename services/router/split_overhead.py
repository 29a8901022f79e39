"""What splitting a request into a remote prefill and a decode adds to its time to first token, as
the router measures it, for the decision to split only where that pays (docs/decisions/0037).

A split request's first token comes after: the prefill on the prefill worker (which the router
predicts like any prefill, from that worker's learned step times), then the KV transfer, the
forward to the decode worker, and the decode side noticing the KV and running its first step. The
router cannot predict the second part from first principles (on vLLM's CPU build it was most of a
split: the connector's handshake and polling, not the bytes), so it measures it: for each request it
split, the time from its decision to the reported first token, less the prefill it predicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SplitOverhead:
    """The overhead of a split in milliseconds: an exponentially weighted mean of the samples
    (``weight`` for the newest), which without new samples drifts back toward ``prior_ms`` with
    ``half_life_s`` — so a router that stopped splitting because splits were slow tries one again
    after a while, and measures whether they still are.

    Guarantees: :meth:`estimate` is ``prior_ms`` before any sample, lies between ``prior_ms`` and
    the last mean afterwards, and moves toward the samples as they come."""

    prior_ms: float = 0.0
    weight: float = 0.2
    half_life_s: float = 120.0
    samples: int = 0
    _mean: float = field(init=False, default=0.0)
    _at: float = field(init=False, default=0.0)

    def estimate(self, now: float) -> float:
        if not self.samples:
            return self.prior_ms
        decay = math.exp(-math.log(2) * max(0.0, now - self._at) / self.half_life_s)
        return self.prior_ms + (self._mean - self.prior_ms) * decay

    def observe(self, sample_ms: float, now: float) -> None:
        sample_ms = max(0.0, sample_ms)
        if self.samples:
            current = self.estimate(now)
            self._mean = current + self.weight * (sample_ms - current)
        else:
            self._mean = sample_ms
        self._at = now
        self.samples += 1


def split_pays(local_cost_ms: float, remote_prefill_ms: float, overhead_ms: float) -> bool:
    """Whether a remote prefill (its first token, plus the split's overhead) is predicted to cost less
    than a local one (its first token, plus the stall it puts on the decode worker's requests)."""
    return remote_prefill_ms + overhead_ms < local_cost_ms
