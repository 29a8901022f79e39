"""The router queue: requests no eligible worker can take now wait here, by priority class, until
capacity frees (docs/decisions/0034).

A request first tries to route at once, unless requests of its model already wait (it then queues
behind them). When every eligible worker is over its busy thresholds, it is held: bounded per class
(``--router-queue-size``), each with a deadline (``--router-queue-timeout-secs``). Whenever the load
picture frees capacity (a first token, an end, another replica's free, a worker joining), the queue
grants one waiting request a new try, chosen by class share (stride scheduling over
``--router-queue-shares``, so a low class is slowed, never starved) and, within a class, first come
first served or shortest uncached prefill first (``--router-queue-policy``). The granted request
routes anew, so its overlap is read again at dequeue; admitted, the next is granted at once; busy
again, it keeps its place and the queue waits for the next free.

Refusals: a full class is refused at once (RESOURCE_EXHAUSTED, HTTP 429), a request whose deadline
passes while it waits is refused then (UNAVAILABLE, HTTP 503); both carry a retry-after estimated
from the queue's recent admission rate.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.wire.priority import Priority, parse_shares

QUEUE_POLICIES = ("fcfs", "spf", "las")
# las: a session's attained service halves this often (recent service counts, old service fades)
ATTAINED_HALF_LIFE_S = 60.0
DEFAULT_SHARES = "high=6,normal=3,low=1"
# admissions counted over this window to estimate how soon a refused request may come back
RATE_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60

T = TypeVar("T")


class AllWorkersBusy(StatusError):
    """Every eligible worker is over its busy thresholds: the request may wait in the queue.
    ``uncached_tokens``: the prompt tokens its best worker lacks (shortest-prefill-first's key)."""

    def __init__(self, details: str, uncached_tokens: int = 0) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
        self.uncached_tokens = uncached_tokens


class QueueRefusal(StatusError):
    """The queue will not hold (or no longer holds) the request; ``retry_after_secs``: when to come back."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_secs: int) -> None:
        super().__init__(code, details)
        self.retry_after_secs = retry_after_secs


@dataclass(frozen=True)
class QueueConfig:
    size: int = 256  # per class; 0: no queue, a busy fleet refuses at once
    timeout_s: float = 30.0
    policy: str = "fcfs"
    shares: dict[str, float] = field(default_factory=lambda: parse_shares(DEFAULT_SHARES))


@dataclass(eq=False)
class Waiting:
    """One waiting request: its class, the order it came in, and its uncached prompt tokens when it
    was queued (shortest-prefill-first's key). ``turn``: resolved when it may try (the live queue);
    ``payload``: what the owner needs to route it (the replay's request)."""

    order: int
    priority: str
    uncached_tokens: int
    enqueued_at: float
    turn: asyncio.Future[None] | None = None
    payload: object = None
    session: str = ""  # its session (empty: a session of its own)
    prompt_tokens: int = 0  # the service it asks for (las)


class QueueListener:
    """What the queue tells its observer (metrics); every method is optional to override."""

    def depth(self, priority: str, depth: int) -> None: ...
    def waited(self, priority: str, seconds: float, outcome: str) -> None: ...
    def refused(self, priority: str, reason: str) -> None: ...


class WaitingRequests:
    """The waiting requests of one model, and which goes next (sans-I/O: the live queue and
    ``kvmesh replay`` both keep theirs in one)."""

    def __init__(self, config: QueueConfig) -> None:
        self.config = config
        self.waiting: dict[str, list[Waiting]] = {p: [] for p in Priority}
        self.passes = dict.fromkeys(Priority, 0.0)  # stride scheduling's virtual time per class
        self.granted: Waiting | None = None
        self.freed_since_grant = False
        # las: each session's admitted prompt tokens and when they were last counted
        self._attained: dict[str, tuple[float, float]] = {}

    def __len__(self) -> int:
        return sum(len(w) for w in self.waiting.values())

    def add(self, entry: Waiting) -> None:
        if not self.waiting[entry.priority]:
            # a class that was idle starts at the busiest's virtual time: it banks no credit while idle
            active = [self.passes[p] for p, w in self.waiting.items() if w]
            self.passes[entry.priority] = max(self.passes[entry.priority], min(active, default=0.0))
        self.waiting[entry.priority].append(entry)

    def remove(self, entry: Waiting) -> None:
        with_class = self.waiting[entry.priority]
        if entry in with_class:
            with_class.remove(entry)
        if self.granted is entry:
            self.granted = None

    def next(self) -> Waiting | None:
        """The request to try next: the class furthest behind its share, then by policy."""
        active = [p for p, w in self.waiting.items() if w]
        if not active:
            return None
        priority = min(active, key=lambda p: (self.passes[p], list(Priority).index(p)))
        waiting = self.waiting[priority]
        if self.config.policy == "spf":
            return min(waiting, key=lambda w: (w.uncached_tokens, w.order))
        if self.config.policy == "las":
            now = max(w.enqueued_at for w in waiting)
            return min(waiting, key=lambda w: (self.attained(w.session, now), w.order))
        return min(waiting, key=lambda w: w.order)

    def attained(self, session: str, now: float) -> float:
        """The prompt tokens ``session`` was admitted with lately (halving every
        :data:`ATTAINED_HALF_LIFE_S`); 0 for a request without a session."""
        value, at = self._attained.get(session, (0.0, now)) if session else (0.0, now)
        return value * 0.5 ** (max(0.0, now - at) / ATTAINED_HALF_LIFE_S)

    def charge(self, entry: Waiting, now: float | None = None) -> None:
        """``entry`` was admitted (at ``now``): its class spends a turn of its share, and its session
        the service it asked for."""
        self.passes[entry.priority] += 1.0 / self.config.shares[entry.priority]
        self.served(entry.session, entry.prompt_tokens, entry.enqueued_at if now is None else now)

    def served(self, session: str, prompt_tokens: int, now: float) -> None:
        """A request of ``session`` was admitted at ``now``, waiting or not (las counts both)."""
        if not session:
            return
        self._attained[session] = (self.attained(session, now) + prompt_tokens, now)
        if len(self._attained) > 1 << 16:  # the sessions served longest ago, whose service has faded most
            for stale, _ in sorted(self._attained.items(), key=lambda item: item[1][1])[: 1 << 14]:
                del self._attained[stale]


class RouterQueue:
    """Holds requests no worker can take, per model and class, and gives them their turn as capacity
    frees. Guarantees: a request waits only while every eligible worker is busy or requests of its
    model already wait (it does not overtake them), and never past its deadline; at most ``size``
    wait per class and model; one waiting request routes at a time per model (what it adds to the
    load picture is seen by the next); a request that leaves (refused, cancelled) never blocks the
    ones behind it."""

    def __init__(
        self,
        config: QueueConfig,
        listener: QueueListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._listener = listener or QueueListener()
        self._clock = clock
        self._models: dict[str, WaitingRequests] = {}
        self._order = itertools.count()
        self._admitted: deque[float] = deque()  # admission times within RATE_WINDOW_S, for retry-after

    @property
    def enabled(self) -> bool:
        return self.config.size > 0

    def depth(self, model: str | None = None, priority: str | None = None) -> int:
        queues = self._models.values() if model is None else [self._models.get(model)]
        return sum(len(q.waiting[priority]) if priority else len(q) for q in queues if q is not None)

    async def route(
        self,
        model: str,
        priority: str,
        attempt: Callable[[], Awaitable[T]],
        prompt_tokens: int = 0,
        session: str = "",
    ) -> T:
        """``attempt()``'s result, once a try is admitted; it raises :class:`AllWorkersBusy` while
        no worker can take the request. Raises :class:`QueueRefusal` when the queue is full or the
        deadline passes first."""
        queue = self._models.get(model)
        uncached_tokens = prompt_tokens  # unknown until a try reads the overlap
        if not self.enabled or queue is None or not len(queue):
            try:
                result = await attempt()
            except AllWorkersBusy as busy:
                if not self.enabled:
                    self._listener.refused(priority, "busy")
                    raise QueueRefusal(busy.code, str(busy), 1) from None
                uncached_tokens = busy.uncached_tokens
            else:
                self._note_admitted()
                if session and self.config.policy == "las":
                    self._models.setdefault(model, WaitingRequests(self.config)).served(
                        session, prompt_tokens, self._clock()
                    )
                return result
            queue = self._models.setdefault(model, WaitingRequests(self.config))
        return await self._wait(model, queue, priority, uncached_tokens, attempt, session, prompt_tokens)

    async def _wait(
        self,
        model: str,
        queue: WaitingRequests,
        priority: str,
        uncached_tokens: int,
        attempt: Callable[[], Awaitable[T]],
        session: str = "",
        prompt_tokens: int = 0,
    ) -> T:
        if len(queue.waiting[priority]) >= self.config.size:
            self._listener.refused(priority, "full")
            raise QueueRefusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"every worker for model {model!r} is busy and the router queue for class {priority!r} is full "
                f"({self.config.size} waiting)",
                self.retry_after(len(queue)),
            )
        loop = asyncio.get_running_loop()
        entry = Waiting(
            next(self._order),
            priority,
            uncached_tokens,
            self._clock(),
            loop.create_future(),
            None,
            session,
            prompt_tokens,
        )
        assert entry.turn is not None
        queue.add(entry)
        self._listener.depth(priority, len(queue.waiting[priority]))
        deadline = entry.enqueued_at + self.config.timeout_s
        outcome = "cancelled"
        try:
            while True:
                remaining = deadline - self._clock()
                try:
                    async with asyncio.timeout(max(remaining, 0.0)):
                        await asyncio.shield(entry.turn)
                except TimeoutError:
                    outcome = "timeout"
                    self._listener.refused(priority, "timeout")
                    raise QueueRefusal(
                        grpc.StatusCode.UNAVAILABLE,
                        f"every worker for model {model!r} stayed busy for the router queue's "
                        f"{self.config.timeout_s:g} s deadline",
                        self.retry_after(len(queue)),
                    ) from None
                try:
                    result = await attempt()
                except AllWorkersBusy:
                    entry.turn = loop.create_future()  # keeps its place; the next free grants anew
                    queue.granted = None
                    if queue.freed_since_grant:
                        self._grant(queue)
                    continue
                outcome = "admitted"
                queue.charge(entry, self._clock())  # a turn counts against its class's share once admitted
                self._note_admitted()
                return result
        finally:
            queue.remove(entry)
            self._listener.depth(priority, len(queue.waiting[priority]))
            self._listener.waited(priority, self._clock() - entry.enqueued_at, outcome)
            if queue.granted is None:
                self._grant(queue)  # the next one tries at once (capacity may remain)

    def capacity_freed(self) -> None:
        """The load picture lost load (a first token, an end, a worker joined): a waiting request of
        each model gets a try."""
        for queue in self._models.values():
            queue.freed_since_grant = True
            if queue.granted is None:
                self._grant(queue)

    def _grant(self, queue: WaitingRequests) -> None:
        entry = queue.next()
        if entry is None:
            return
        queue.granted = entry
        queue.freed_since_grant = False
        if entry.turn is not None and not entry.turn.done():
            entry.turn.set_result(None)

    def _note_admitted(self) -> None:
        now = self._clock()
        self._admitted.append(now)
        while self._admitted and self._admitted[0] < now - RATE_WINDOW_S:
            self._admitted.popleft()

    def retry_after(self, waiting: int) -> int:
        """Seconds until a request behind ``waiting`` others would likely be admitted, at the rate
        admissions went lately (1 to 60)."""
        now = self._clock()
        recent = sum(1 for t in self._admitted if t >= now - RATE_WINDOW_S)
        if not recent:
            return min(MAX_RETRY_AFTER_S, max(1, math.ceil(self.config.timeout_s)))
        rate = recent / RATE_WINDOW_S
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil((waiting + 1) / rate)))
