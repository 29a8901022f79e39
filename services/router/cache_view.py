"""The second stage of a routing decision: what the router takes each worker to hold of the
request's prompt (sans-I/O, clock passed in).

A view starts from an index's answer (:class:`~kvmesh.common.core.index_answer.IndexAnswer`: the
indexer replicas', or in ``kvmesh replay`` the replay's own index's) or, in approximate mode
(``--no-kv-events``), from the router's memory of where it sent what. To that it adds:

- tier credits: blocks a worker holds past its device match in host memory, on disk or in its KV
  pool, each counted as a share of a device block (docs/decisions/0036);
- predict-on-route: blocks a worker was just sent, taken as cached there until its KV events can
  have reached the indexers (docs/decisions/0035);
- session affinity: the worker that served a session's last turn, credited with a share of the
  blocks the new turn shares with it (:mod:`~kvmesh.router.session_affinity`, docs/decisions/0046);
- for a MoE request, the share of its experts each worker's cached blocks were computed with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvmesh.common.core.index_answer import IndexAnswer
from kvmesh.common.core.tier_credits import TierCredits, credited_matches
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.router.approximate_index import ApproximateIndex
from kvmesh.router.candidates import Prepared
from kvmesh.router.predicted_blocks import PredictedBlocks
from kvmesh.router.session_affinity import SessionAffinity


class CacheView(NamedTuple):
    """Per worker: the matched prefix in blocks (credited and predicted), its tree size (for
    tie-breaking), the share of the request's MoE experts it hosts, and the prefix it caches in device
    memory as the index reports it, nothing added (what another worker can pull: decision 70)."""

    matched: dict[WorkerKey, int]
    tree_sizes: dict[WorkerKey, int]
    moe_hosted: dict[WorkerKey, float] = {}
    cached: dict[WorkerKey, int] = {}

    def uncached_tokens(self, prepared: Prepared) -> int:
        """The prompt tokens the candidate with the longest cached prefix lacks."""
        best = max((self.matched.get(key, 0) for key in prepared.keys), default=0)
        return max(0, prepared.prompt_tokens - best * prepared.block_size)


NO_VIEW = CacheView({}, {})


def moe_hosted_shares(moe: dict[WorkerKey, tuple[int, int]], query: Sequence[Any]) -> dict[WorkerKey, float]:
    """Per worker, the share of the request's distinct MoE experts its cached blocks were computed with."""
    wanted = len({(e.layer, e.expert) for e in query})
    return {worker: min(1.0, hosted / wanted) for worker, (_aligned, hosted) in moe.items()} if wanted else {}


class CacheViews:
    """Builds each request's :class:`CacheView`. Guarantees: a prediction never lowers what the
    index reports (a match is the larger of the two), and expires after ``predicted_ttl_s``."""

    def __init__(
        self,
        credits: TierCredits,
        predicted_ttl_s: float,
        clock: Callable[[], float],
        *,
        kv_events: bool = True,
        approximate_ttl_s: float = 120.0,
        approximate_max_size: int = 1 << 20,
        sessions: SessionAffinity | None = None,
    ) -> None:
        """``kv_events`` False: approximate mode (the view is the router's memory of its own decisions,
        each entry expiring after ``approximate_ttl_s``)."""
        self.credits = credits
        self.predicted_ttl_s = predicted_ttl_s
        self.clock = clock
        self.kv_events = kv_events
        self._approximate_ttl_s = approximate_ttl_s
        self._approximate_max_size = approximate_max_size
        self._approximate: dict[int, ApproximateIndex] = {}  # by block size
        # blocks a worker was just sent, held until its KV events can have reached the indexers
        self._predicted: dict[int, PredictedBlocks] = {}  # by block size
        self.sessions = sessions if sessions is not None else SessionAffinity(0.0, 0.0)

    def of(self, prepared: Prepared, answer: IndexAnswer, *, predictions: bool = True) -> CacheView:
        """The view of ``prepared`` from an index's ``answer`` (kv events) or from approximate mode's
        memory (the answer is then unused). ``predictions`` False: the answer is exact already (the
        replay's oracle), nothing is added to it."""
        if not self.kv_events:
            approximate = self.approximate_index(prepared.block_size)
            matched = approximate.find_matches_by_sequence(prepared.block_hashes, self.clock())
            return CacheView(matched, dict(approximate.tree_sizes()))
        matched = answer.matched
        cached = matched if answer.held is None else answer.held
        if answer.pooled or answer.host or answer.disk:
            matched = credited_matches(matched, self.credits, pooled=answer.pooled, host=answer.host, disk=answer.disk)
        predicted = self._predicted.get(prepared.block_size) if predictions else None
        if predicted is not None:
            guessed = predicted.matches(prepared.block_hashes, self.clock())
            if guessed:
                matched = dict(matched)
                for worker, blocks in guessed.items():
                    matched[worker] = max(matched.get(worker, 0), blocks)
        session = prepared.request.session
        credited = self.sessions.credited(session, prepared.block_hashes, self.clock()) if session else None
        if credited is not None:
            key, blocks = credited
            if matched.get(key, 0) < blocks:
                matched = {**matched, key: blocks}
        moe = moe_hosted_shares(answer.moe, prepared.request.moe_query) if answer.moe else {}
        return CacheView(matched, answer.tree_sizes, moe, cached)

    def routed(self, key: WorkerKey, prepared: Prepared, overlap: int = 0) -> None:
        """``prepared`` was sent to ``key``: approximate mode remembers it; with KV events it is
        predicted there (:meth:`predict`)."""
        self.sessions.routed(prepared.request.session, key, prepared.block_hashes, self.clock())
        if self.kv_events:
            self.predict(key, prepared.block_size, prepared.block_hashes, overlap)
        else:
            self.approximate_index(prepared.block_size).record(
                key, prepared.local_hashes, prepared.block_hashes, self.clock()
            )

    def predict(self, key: WorkerKey, block_size: int, block_hashes: Sequence[int], overlap: int = 0) -> None:
        """Predict-on-route: ``key`` is taken to cache these blocks for ``--router-predicted-ttl-secs``
        (its KV events take longer than a burst of siblings takes to arrive). Nothing is predicted
        where the worker's known match (``overlap``) already covers every block."""
        if self.predicted_ttl_s <= 0 or not self.kv_events or overlap >= len(block_hashes):
            return
        predicted = self._predicted.get(block_size)
        if predicted is None:
            predicted = self._predicted[block_size] = PredictedBlocks(self.predicted_ttl_s)
        predicted.record(key, block_hashes, self.clock())

    def approximate_index(self, block_size: int) -> ApproximateIndex:
        """Approximate mode's view of the caches of workers with this block size."""
        index = self._approximate.get(block_size)
        if index is None:
            index = self._approximate[block_size] = ApproximateIndex(
                block_size, self._approximate_ttl_s, self._approximate_max_size
            )
        return index

    def worker_left(self, worker_id: int) -> None:
        """Forget every rank of a departed worker."""
        for index in (*self._approximate.values(), *self._predicted.values()):
            index.remove_worker(worker_id)
        self.sessions.forget_worker(worker_id)
