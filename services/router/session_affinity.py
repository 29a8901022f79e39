"""Soft, expiring session affinity (sans-I/O, clock passed in; docs/decisions/0046).

A session's turns share a growing prefix, and its last turn's worker holds it, or held it. The
affinity remembers, per session, the worker (and rank) that served its last turn and that turn's
blocks, for ``ttl_s`` after it: the cache view then credits that worker with the blocks the new turn
shares with the last one, times ``credit``, where the index does not report them already. It is a
preference in the cost, never a pin: a worker that is busier than the prefix is worth loses the
turn, and one that left is not a candidate at all.

It also counts, per worker, the sessions parked there: those whose last turn went there within
``PARKED_WITHIN_S`` (:meth:`SessionAffinity.parked`), which a new session's placement weighs
(docs/decisions/0072).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.common.wire.worker_key import WorkerKey

# a session whose last turn came this recently is taken to be mid-conversation, its next turn to come:
# an agent's steps come seconds apart and a person's replies mostly within a minute, while a session
# counted for the whole affinity ttl (10 minutes) would count the many that have ended
PARKED_WITHIN_S = 60.0


@dataclass(frozen=True)
class Affinity:
    session: str
    key: WorkerKey
    block_hashes: tuple[int, ...]
    until: float
    gap_s: float = math.inf  # after the session's turn before it (inf: none kept)


def parked_charges(workers: Sequence[WorkerKey], parked: Mapping[WorkerKey, int], per_session_ms: float) -> list[float]:
    """Per candidate in ``workers``, ``per_session_ms`` for each session parked there beyond the
    candidates' mean (0 at or below it).

    Why: a session between turns runs nothing, so a worker whose sessions are parked looks idle to the
    cost, and a new session placed there joins them; when they come back, their decodes share its steps
    and slow every prefill beside them (on the agent loops of issue 45, arrivals met 0.23-0.37 decodes
    above the fleet's mean). A small charge spreads new sessions where the costs are close, and leaves
    a real difference in cost to decide (docs/decisions/0072)."""
    counts = [parked.get(worker, 0) for worker in workers]
    mean = sum(counts) / len(counts)
    return [per_session_ms * max(0.0, count - mean) for count in counts]


class SessionAffinity:
    """Guarantees: an entry lives ``ttl_s`` after the session's last routed turn, at most
    ``max_sessions`` are kept (the least recently routed go first), and a departed worker's go with it.
    A session counts as parked on its last turn's worker for ``PARKED_WITHIN_S`` (at most ``ttl_s``)
    after that turn, and only while its entry is kept."""

    def __init__(self, ttl_s: float, credit: float, max_sessions: int = 1 << 17) -> None:
        self.ttl_s = ttl_s
        self.credit = credit
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, Affinity] = OrderedDict()  # least recently routed first
        # the sessions parked, in routing order (session -> its worker, routed at), and their count per
        # worker, kept as turns come and go: read for every new session, a scan of the entries is too slow.
        # Routing order is time order (each turn is recorded at the router's clock), so the oldest leave first
        self._recent: OrderedDict[str, tuple[WorkerKey, float]] = OrderedDict()
        self._parked: Counter[WorkerKey] = Counter()

    @property
    def enabled(self) -> bool:
        """Whether sessions are kept at all (``ttl_s`` > 0); they weigh in the cost only with a credit."""
        return self.ttl_s > 0

    def routed(self, session: str, key: WorkerKey, block_hashes: Sequence[int], now: float) -> None:
        """A turn of ``session`` was sent to ``key`` (by this replica or, synced, another)."""
        if not session or not self.enabled:
            return
        blocks = tuple(block_hashes)
        last = self._entries.pop(session, None)
        if last is None or last.until <= now:
            gap = math.inf
        elif last.block_hashes == blocks:  # the same turn again (a retry, a split's other half): no new gap
            gap = last.gap_s
        else:
            gap = now - (last.until - self.ttl_s)
        worker = WorkerKey(*key)
        self._entries[session] = Affinity(session, worker, blocks, now + self.ttl_s, gap)
        self._unpark(session)
        self._recent[session] = (worker, now)
        self._parked[worker] += 1
        self._expire(now)
        while len(self._entries) > self.max_sessions:
            self._unpark(self._entries.popitem(last=False)[0])

    def credited(self, session: str, block_hashes: Sequence[int], now: float) -> tuple[WorkerKey, int] | None:
        """The session's worker and the blocks it is credited with for a turn of these blocks: the
        prefix shared with the session's last turn, times the credit (None: no live affinity)."""
        entry = self._entries.get(session) if session and self.credit > 0 else None
        if entry is None or entry.until <= now:
            return None
        shared = 0
        for mine, theirs in zip(block_hashes, entry.block_hashes, strict=False):
            if mine != theirs:
                break
            shared += 1
        blocks = round(self.credit * shared)
        return (entry.key, blocks) if blocks else None

    def continues_loop(self, session: str, now: float, within_s: float) -> bool:
        """Whether a turn of ``session`` at ``now`` comes within ``within_s`` of the session's last
        routed turn (by any replica), which itself came within ``within_s`` of the one before: a loop's
        next step, an agent's tool call answered, rather than a person's reply.

        Why two quick turns in a row: one alone is as often a person's short reply (a chat's think
        time is exponential, and a fifth of the family's chat turns come within 10 s), and a chat
        moved off its holder for one such turn lost its prefix there (the held-out chats' reuse
        0.463 against 0.480 when only a second quick turn counts); an agent's steps come quick after
        quick, so only its second step is held (docs/decisions/0064)."""
        entry = self._entries.get(session) if session and within_s > 0 else None
        if entry is None or entry.until <= now or now - (entry.until - self.ttl_s) >= within_s:
            return False
        return entry.gap_s < within_s

    def starts(self, session: str, now: float) -> bool:
        """Whether a turn of ``session`` at ``now`` starts it, as far as this router knows: sessions are
        kept and none of its turns was routed within ``ttl_s`` (no worker holds its context for it)."""
        if not session or not self.enabled:
            return False
        entry = self._entries.get(session)
        return entry is None or entry.until <= now

    def forget_worker(self, worker_id: int) -> None:
        for session in [s for s, e in self._entries.items() if e.key.worker_id == worker_id]:
            del self._entries[session]
            self._unpark(session)

    def parked(self, now: float) -> Mapping[WorkerKey, int]:
        """Per worker, the sessions whose last turn went there within ``PARKED_WITHIN_S`` of ``now``
        (by any replica; a worker with none may be missing). Read-only: the counts change as turns come."""
        horizon = now - min(PARKED_WITHIN_S, self.ttl_s)
        while self._recent:
            session, (_worker, at) = next(iter(self._recent.items()))
            if at > horizon:
                break
            self._unpark(session)
        return self._parked

    def _unpark(self, session: str) -> None:
        parked = self._recent.pop(session, None)
        if parked is not None:
            self._parked[parked[0]] -= 1
            if not self._parked[parked[0]]:
                del self._parked[parked[0]]

    def live(self, now: float) -> list[Affinity]:
        """Every live entry, the most recently routed first."""
        self._expire(now)
        return list(reversed(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        # entries are kept in routing order, and each lives ttl_s past it: the oldest expire first
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.until > now:
                break
            self._unpark(self._entries.popitem(last=False)[0])
