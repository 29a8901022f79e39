"""Worker selection: the KV cost function and the simple policies (sans-I/O).

KV mode (DESIGN §5): ``cost = overlap_score_weight × prefill_blocks + decode_blocks`` where
``prefill_blocks`` is the predicted prefill work left after the cached prefix, including prefill
already queued on the worker (in blocks, fractional), and ``decode_blocks`` the predicted active
blocks after adding the request. Lowest cost wins; ``temperature > 0`` samples from a softmax over
costs normalised by their range; ties break toward the worker with the smaller tree, then at random.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

WorkerKey = tuple[int, int]


@dataclass(frozen=True)
class Candidate:
    """What the selector knows of one worker for one request."""

    worker: WorkerKey
    prefill_tokens: int
    decode_blocks: int
    overlap_blocks: int = 0
    tree_size: int = 0


def kv_cost(prefill_blocks: float, decode_blocks: float, overlap_score_weight: float) -> float:
    return overlap_score_weight * prefill_blocks + decode_blocks


def candidate_cost(candidate: Candidate, block_size: int, overlap_score_weight: float) -> float:
    return kv_cost(candidate.prefill_tokens / block_size, candidate.decode_blocks, overlap_score_weight)


def softmax_sample(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index sampled with probability ∝ exp(−normalised cost / temperature)."""
    low, high = min(costs), max(costs)
    spread = high - low
    normalised = [(c - low) / spread if spread > 0 else 0.0 for c in costs]
    weights = [math.exp(-n / temperature) for n in normalised]
    return rng.choices(range(len(costs)), weights=weights, k=1)[0]


class KvSelector:
    """Chooses the lowest-cost candidate (or samples one at ``temperature > 0``)."""

    def __init__(self, block_size: int, rng: random.Random | None = None) -> None:
        self.block_size = block_size
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Candidate], overlap_score_weight: float, temperature: float) -> Candidate:
        if not candidates:
            raise ValueError("no candidate workers")
        costs = [candidate_cost(c, self.block_size, overlap_score_weight) for c in candidates]
        if temperature > 0:
            return candidates[softmax_sample(costs, temperature, self._rng)]
        best = min(costs)
        tied = [c for c, cost in zip(candidates, costs, strict=True) if math.isclose(cost, best, abs_tol=1e-9)]
        smallest_tree = min(c.tree_size for c in tied)
        tied = [c for c in tied if c.tree_size == smallest_tree]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


class RoundRobinSelector:
    """Cycles through the workers in a stable order."""

    def __init__(self) -> None:
        self._counter = 0

    def select(self, workers: Sequence[WorkerKey]) -> WorkerKey:
        ordered = sorted(workers)
        choice = ordered[self._counter % len(ordered)]
        self._counter += 1
        return choice


class RandomSelector:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: Sequence[WorkerKey]) -> WorkerKey:
        return self._rng.choice(sorted(workers))
