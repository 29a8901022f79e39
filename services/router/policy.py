"""The routing decision for one block size, without I/O: the router service and ``kvmesh replay``
both drive this class, so what the replay measures is what the service does.

It owns the load picture (:class:`ActiveSequences`) and the selectors. Given the candidate workers,
the request's block hashes and, in KV mode, each worker's cached overlap and tree size, it returns
the chosen worker and records the request on it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.common.worker_key import WorkerKey
from kvmesh.router.active_sequences import ActiveSequences
from kvmesh.router.scheduler import (
    BlockCost,
    Candidate,
    CostModel,
    KvSelector,
    RandomSelector,
    RoundRobinSelector,
)


@dataclass(frozen=True)
class Decision:
    worker: WorkerKey
    overlap_blocks: int


class RoutingPolicy:
    """Chooses workers in one of the modes ``kv``, ``round-robin`` or ``random``."""

    def __init__(
        self,
        mode: str,
        block_size: int,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
        rng: random.Random | None = None,
        cost_model: CostModel | None = None,
        track_active_blocks: bool = True,
        track_output_blocks: bool = False,
        active: ActiveSequences | None = None,
    ) -> None:
        """``cost_model`` defaults to Dynamo's block cost; the service and replay pass the one configured.
        ``active`` is the load picture to read (a :class:`LoadTracker`'s for this block size); by
        default the policy keeps its own."""
        if mode not in ("kv", "round-robin", "random"):
            raise ValueError(f"unknown routing mode {mode!r}")
        self.mode = mode
        self.block_size = block_size
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._rng = rng or random.Random()
        self.active = (
            active if active is not None else ActiveSequences(block_size, track_active_blocks, track_output_blocks)
        )
        self.cost_model = cost_model or BlockCost(block_size)
        self._kv = KvSelector(self.cost_model, self._rng)
        self._round_robin = RoundRobinSelector()
        self._random = RandomSelector(self._rng)

    @property
    def needs_overlaps(self) -> bool:
        return self.mode == "kv"

    def choose(
        self,
        workers: Sequence[WorkerKey],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlaps: Mapping[WorkerKey, int] | None = None,
        tree_sizes: Mapping[WorkerKey, int] | None = None,
        overlap_score_weight: float | None = None,
        temperature: float | None = None,
        expected_output_tokens: int = 0,
    ) -> Decision:
        """Pick a worker (per-request weight / temperature override the defaults when given)."""
        if not workers:
            raise ValueError("no candidate workers")
        if self.mode == "round-robin":
            return Decision(self._round_robin.select(workers), 0)
        if self.mode == "random":
            return Decision(self._random.select(workers), 0)
        overlaps = overlaps or {}
        tree_sizes = tree_sizes or {}
        loads = self.active.potential_loads(
            workers, block_hashes, prompt_tokens, dict(overlaps), expected_output_tokens
        )
        candidates = [
            Candidate(
                load.worker,
                load.prefill_tokens,
                load.decode_blocks,
                overlaps.get(load.worker, 0),
                tree_sizes.get(load.worker, 0),
            )
            for load in loads
        ]
        choice = self._kv.select(
            candidates,
            self.overlap_score_weight if overlap_score_weight is None else overlap_score_weight,
            self.temperature if temperature is None else temperature,
        )
        return Decision(choice.worker, choice.overlap_blocks)
