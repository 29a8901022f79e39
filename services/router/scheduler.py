"""Worker selection: the KV cost models and the simple policies (sans-I/O).

Two cost models, both fed the same prediction of each worker's load (prefill tokens queued there
including this request's uncached part, and active KV blocks after adding it):

- ``blocks`` (DESIGN §5, NVIDIA Dynamo's formula):
  ``cost = overlap_score_weight × prefill_blocks + decode_blocks``;
- ``ttft`` (the default, docs/decisions/0005): the predicted time to this request's first token —
  the queued prefill cut into engine steps of ``max_num_batched_tokens`` and costed with the timing
  model, plus the decode work each of those steps carries:
  ``cost = overlap_score_weight × Σ prefill_ms(chunk) + steps × decode_ms(active blocks)``.

Lowest cost wins; ``temperature > 0`` samples from a softmax over costs normalised by their range;
ties break toward the worker with the smaller tree, then at random.

The simple policies: round robin, random, and SGLang's power of two (cache-aware is in
:mod:`~kvmesh.router.cache_aware`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.common.timing import TimingModel
from kvmesh.common.worker_key import WorkerKey


@dataclass(frozen=True)
class Candidate:
    """What the selector knows of one worker for one request."""

    worker: WorkerKey
    prefill_tokens: int
    decode_blocks: int
    overlap_blocks: int = 0
    tree_size: int = 0


def kv_cost(prefill_blocks: float, decode_blocks: float, overlap_score_weight: float) -> float:
    """Dynamo's KV cost in blocks."""
    return overlap_score_weight * prefill_blocks + decode_blocks


class CostModel(Protocol):
    name: str

    def cost(self, candidate: Candidate, overlap_score_weight: float) -> float: ...


@dataclass(frozen=True)
class BlockCost:
    """``overlap_score_weight × prefill_blocks + decode_blocks`` (DESIGN §5, Dynamo's formula)."""

    block_size: int
    name: str = "blocks"

    def cost(self, candidate: Candidate, overlap_score_weight: float) -> float:
        return kv_cost(candidate.prefill_tokens / self.block_size, candidate.decode_blocks, overlap_score_weight)


@dataclass(frozen=True)
class PredictedTtftCost:
    """Predicted milliseconds to this request's first token on the candidate worker.

    Assumes the engine drains queued prefill in steps of ``max_num_batched_tokens`` (chunked
    prefill, FCFS) and that every such step also advances the worker's decoding requests.
    """

    block_size: int
    max_num_batched_tokens: int
    capacity_tokens: int
    timing: TimingModel = field(default_factory=TimingModel)
    name: str = "ttft"
    # one full prefill step, computed once (the cost runs for every candidate of every request)
    _full_step_ms: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_full_step_ms", self.timing.prefill_ms(self.max_num_batched_tokens))

    def cost(self, candidate: Candidate, overlap_score_weight: float) -> float:
        full_steps, remainder = divmod(candidate.prefill_tokens, self.max_num_batched_tokens)
        prefill_ms = full_steps * self._full_step_ms + self.timing.prefill_ms(remainder)
        steps = max(1, full_steps + (1 if remainder else 0))
        blocks = candidate.decode_blocks
        decode_ms = self.timing.decode_ms(blocks * self.block_size, self.capacity_tokens, blocks > 0)
        return overlap_score_weight * prefill_ms + steps * decode_ms


class PerWorkerTtftCost:
    """:class:`PredictedTtftCost` with each worker's own timing model where one is known (fitted from
    the steps it ran, see :mod:`kvmesh.common.timing_fit`), the shared prior elsewhere — so workers
    of different speeds get different costs."""

    name = "ttft"

    def __init__(self, block_size: int, max_num_batched_tokens: int, capacity_tokens: int, prior: TimingModel) -> None:
        self._shape = (block_size, max_num_batched_tokens, capacity_tokens)
        self.default = PredictedTtftCost(*self._shape, prior)
        self._by_worker: dict[WorkerKey, PredictedTtftCost] = {}

    def set_timing(self, worker: WorkerKey, timing: TimingModel) -> None:
        self._by_worker[worker] = PredictedTtftCost(*self._shape, timing)

    def timing(self, worker: WorkerKey) -> TimingModel:
        return self._by_worker.get(worker, self.default).timing

    def forget(self, worker: WorkerKey) -> None:
        self._by_worker.pop(worker, None)

    def cost(self, candidate: Candidate, overlap_score_weight: float) -> float:
        return self._by_worker.get(candidate.worker, self.default).cost(candidate, overlap_score_weight)


COST_MODELS = ("ttft", "blocks")


def make_cost_model(
    name: str,
    block_size: int,
    max_num_batched_tokens: int,
    capacity_blocks: int,
    prior: TimingModel | None = None,
) -> CostModel:
    """The named cost model for workers of this shape (``prior``: the ttft cost's timing model until
    a worker's own is known; Dynamo's mocker constants by default)."""
    if name == "blocks":
        return BlockCost(block_size)
    if name == "ttft":
        return PerWorkerTtftCost(
            block_size, max_num_batched_tokens, capacity_blocks * block_size, prior or TimingModel()
        )
    raise ValueError(f"unknown KV cost model {name!r}; choose one of {', '.join(COST_MODELS)}")


def candidate_cost(candidate: Candidate, block_size: int, overlap_score_weight: float) -> float:
    """Dynamo's block cost of a candidate (kept for readers comparing with the design's example)."""
    return BlockCost(block_size).cost(candidate, overlap_score_weight)


def softmax_sample(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index sampled with probability ∝ exp(−normalised cost / temperature)."""
    low, high = min(costs), max(costs)
    spread = high - low
    normalised = [(c - low) / spread if spread > 0 else 0.0 for c in costs]
    weights = [math.exp(-n / temperature) for n in normalised]
    return rng.choices(range(len(costs)), weights=weights, k=1)[0]


class KvSelector:
    """Chooses the lowest-cost candidate (or samples one at ``temperature > 0``)."""

    def __init__(self, cost_model: CostModel, rng: random.Random | None = None) -> None:
        self.cost_model = cost_model
        self._rng = rng or random.Random()

    def select(
        self,
        candidates: Sequence[Candidate],
        overlap_score_weight: float,
        temperature: float,
        discounts: Mapping[WorkerKey, float] | None = None,
    ) -> Candidate:
        """``discounts``: a share (0..1) of a worker's cost to waive (MoE expert locality)."""
        if not candidates:
            raise ValueError("no candidate workers")
        costs = [self.cost_model.cost(c, overlap_score_weight) for c in candidates]
        if discounts:
            costs = [cost * (1 - discounts.get(c.worker, 0.0)) for c, cost in zip(candidates, costs, strict=True)]
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


class PowerOfTwoSelector:
    """SGLang's ``power_of_two``: two distinct workers drawn at random, the less loaded one wins
    (ties: the first drawn). The load is the caller's (kvmesh: the router's own prediction)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: Sequence[WorkerKey], load: Callable[[WorkerKey], float]) -> WorkerKey:
        if len(workers) == 1:
            return workers[0]
        first, second = self._rng.sample(sorted(workers), 2)
        return second if load(second) < load(first) else first
