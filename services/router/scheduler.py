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

import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.wire.worker_key import WorkerKey

# From this many candidates the ttft cost is computed with numpy (measured: slower below, where the
# arrays cost more than the loop they replace).
VECTORISE_FROM = 128


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

    def costs(
        self,
        workers: Sequence[WorkerKey],
        prefill_tokens: Sequence[int],
        decode_blocks: Sequence[int],
        overlap_score_weight: float,
    ) -> list[float]:
        """:meth:`cost` of every worker at once, from columns (the routing decision's hot path:
        no object per candidate)."""
        ...


@dataclass(frozen=True)
class BlockCost:
    """``overlap_score_weight × prefill_blocks + decode_blocks`` (DESIGN §5, Dynamo's formula)."""

    block_size: int
    name: str = "blocks"

    def cost(self, candidate: Candidate, overlap_score_weight: float) -> float:
        return kv_cost(candidate.prefill_tokens / self.block_size, candidate.decode_blocks, overlap_score_weight)

    def costs(
        self,
        workers: Sequence[WorkerKey],
        prefill_tokens: Sequence[int],
        decode_blocks: Sequence[int],
        overlap_score_weight: float,
    ) -> list[float]:
        size = self.block_size
        return [overlap_score_weight * (p / size) + d for p, d in zip(prefill_tokens, decode_blocks, strict=True)]


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
    _constants: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_full_step_ms", self.timing.prefill_ms(self.max_num_batched_tokens))
        object.__setattr__(self, "_constants", self._make_constants())

    def cost(self, candidate: Candidate, overlap_score_weight: float) -> float:
        worker, prefill, blocks = candidate.worker, candidate.prefill_tokens, candidate.decode_blocks
        return self.costs((worker,), (prefill,), (blocks,), overlap_score_weight)[0]

    @property
    def constants(self) -> tuple[float, ...]:
        """What :func:`ttft_costs` needs of this model, in its order."""
        return self._constants

    def _make_constants(self) -> tuple[float, ...]:
        timing = self.timing
        return (
            timing.prefill_a,
            timing.prefill_b,
            timing.prefill_c,
            timing.decode_a,
            timing.decode_b,
            timing.decode_c,
            self.max_num_batched_tokens,
            self._full_step_ms,
            self.block_size / self.capacity_tokens,
        )

    def costs(
        self,
        workers: Sequence[WorkerKey],
        prefill_tokens: Sequence[int],
        decode_blocks: Sequence[int],
        overlap_score_weight: float,
    ) -> list[float]:
        if len(prefill_tokens) >= VECTORISE_FROM:
            return self._costs_vectorised(prefill_tokens, decode_blocks, overlap_score_weight)
        return ttft_costs(itertools.repeat(self.constants), prefill_tokens, decode_blocks, overlap_score_weight)

    def _costs_vectorised(
        self, prefill_tokens: Sequence[int], decode_blocks: Sequence[int], overlap_score_weight: float
    ) -> list[float]:
        """:meth:`costs` in numpy: the same arithmetic, cheaper than the loop from about 128 workers on."""
        timing = self.timing
        prefill = np.asarray(prefill_tokens, dtype=np.float64)
        blocks = np.asarray(decode_blocks, dtype=np.float64)
        full_steps = np.floor_divide(prefill, self.max_num_batched_tokens)
        remainder = prefill - full_steps * self.max_num_batched_tokens
        tail_ms = (timing.prefill_a * remainder + timing.prefill_b) * remainder + timing.prefill_c
        prefill_ms = full_steps * self._full_step_ms + np.where(remainder > 0, tail_ms, 0.0)
        steps = np.maximum(full_steps + (remainder > 0), 1.0)
        u = np.minimum(blocks * (self.block_size / self.capacity_tokens), 1.0)
        decode_ms = np.maximum((timing.decode_a * u + timing.decode_b) * u + timing.decode_c, 1.0)
        costs = overlap_score_weight * prefill_ms + steps * np.where(blocks > 0, decode_ms, 0.0)
        return costs.tolist()


def ttft_costs(
    constants: Iterable[tuple[float, ...]],
    prefill_tokens: Sequence[int],
    decode_blocks: Sequence[int],
    overlap_score_weight: float,
) -> list[float]:
    """:meth:`PredictedTtftCost.costs` with each worker's model constants (:attr:`~PredictedTtftCost.constants`):
    TimingModel.prefill_ms and decode_ms inlined, since this loop runs for every candidate of every request."""
    result: list[float] = []
    add = result.append
    model: tuple[float, ...] | None = None
    # `constants` may repeat one model endlessly (itertools.repeat): the columns set the length
    for constants_now, prefill, blocks in zip(constants, prefill_tokens, decode_blocks, strict=False):
        if constants_now is not model:  # unpacked once per model, not once per worker
            model = constants_now
            pa, pb, pc, da, db, dc, step_tokens, full_step_ms, context_per_block = model
        if prefill < step_tokens:  # the common case, without divmod's call
            steps = 1
            prefill_ms = (pa * prefill + pb) * prefill + pc if prefill > 0 else 0.0
        else:
            full_steps, remainder = divmod(prefill, step_tokens)
            prefill_ms = full_steps * full_step_ms
            steps = full_steps
            if remainder > 0:
                prefill_ms += (pa * remainder + pb) * remainder + pc
                steps += 1
        if blocks > 0:
            u = blocks * context_per_block
            if u > 1.0:
                u = 1.0
            decode_ms = (da * u + db) * u + dc
            add(overlap_score_weight * prefill_ms + steps * (decode_ms if decode_ms > 1.0 else 1.0))
        else:
            add(overlap_score_weight * prefill_ms)
    return result


class PerWorkerTtftCost:
    """:class:`PredictedTtftCost` with each worker's own timing model where one is known (fitted from
    the steps it ran, see :mod:`kvmesh.common.core.timing_fit`), the shared prior elsewhere — so workers
    of different speeds get different costs."""

    name = "ttft"

    def __init__(self, block_size: int, max_num_batched_tokens: int, capacity_tokens: int, prior: TimingModel) -> None:
        self._shape = (block_size, max_num_batched_tokens, capacity_tokens)
        self.default = PredictedTtftCost(*self._shape, prior)
        self._by_worker: dict[WorkerKey, PredictedTtftCost] = {}
        self._constants: dict[WorkerKey, tuple[float, ...]] = {}  # each one's PredictedTtftCost.constants

    def set_timing(self, worker: WorkerKey, timing: TimingModel) -> None:
        self._by_worker[worker] = PredictedTtftCost(*self._shape, timing)
        self._constants[worker] = self._by_worker[worker].constants

    def timing(self, worker: WorkerKey) -> TimingModel:
        return self._by_worker.get(worker, self.default).timing

    def forget(self, worker: WorkerKey) -> None:
        self._by_worker.pop(worker, None)
        self._constants.pop(worker, None)

    def cost(self, candidate: Candidate, overlap_score_weight: float) -> float:
        return self._by_worker.get(candidate.worker, self.default).cost(candidate, overlap_score_weight)

    def costs(
        self,
        workers: Sequence[WorkerKey],
        prefill_tokens: Sequence[int],
        decode_blocks: Sequence[int],
        overlap_score_weight: float,
    ) -> list[float]:
        if not self._by_worker:
            return self.default.costs(workers, prefill_tokens, decode_blocks, overlap_score_weight)
        # each worker with a fitted model of its own is costed with its constants, the rest with the prior's
        by_worker, prior = self._constants, self.default.constants
        constants = [by_worker.get(worker, prior) for worker in workers]
        return ttft_costs(constants, prefill_tokens, decode_blocks, overlap_score_weight)


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
        workers = [c.worker for c in candidates]
        costs = self.cost_model.costs(
            workers, [c.prefill_tokens for c in candidates], [c.decode_blocks for c in candidates], overlap_score_weight
        )
        index = self.pick(workers, costs, [c.tree_size for c in candidates], temperature, discounts)
        return candidates[index]

    def pick(
        self,
        workers: Sequence[WorkerKey],
        costs: list[float],
        tree_sizes: Sequence[int] | Mapping[WorkerKey, int],
        temperature: float,
        discounts: Mapping[WorkerKey, float] | None = None,
    ) -> int:
        """The index of the worker :meth:`select` chooses, from its costs (the column-wise path).
        ``tree_sizes``: per index, or per worker (only read for tied workers)."""
        if discounts:
            costs = [cost * (1 - discounts.get(w, 0.0)) for w, cost in zip(workers, costs, strict=True)]
        if temperature > 0:
            return softmax_sample(costs, temperature, self._rng)
        best = min(costs)
        # math.isclose(cost, best, abs_tol=1e-9) for the few costs within twice its tolerance of the best
        near = best + 2 * max(1e-9, 1e-9 * abs(best))
        tied = [i for i, cost in enumerate(costs) if cost <= near and math.isclose(cost, best, abs_tol=1e-9)]
        if len(tied) > 1:
            if isinstance(tree_sizes, Mapping):
                size = {i: tree_sizes.get(workers[i], 0) for i in tied}
            else:
                size = {i: tree_sizes[i] for i in tied}
            smallest_tree = min(size.values())
            tied = [i for i in tied if size[i] == smallest_tree]
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
