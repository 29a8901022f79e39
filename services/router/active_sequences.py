"""Predicted load of every worker from the requests the router has sent it (sans-I/O).

For each worker (and data-parallel rank) the router tracks its in-flight requests:

- *prefill tokens*: prompt tokens not served from cache, for requests whose first token has not
  arrived yet (prefill queued or running there);
- *decode blocks*: KV blocks held by active requests, where a prefix shared by several requests
  counts once (full prompt blocks are identified by sequence hash) and each request's own blocks —
  its partial last prompt block and, with ``track_output_blocks``, the blocks its output fills (or
  is expected to fill, given a length hint) — count for that request alone.

The updates mirror a request's life: :meth:`add` on routing, :meth:`mark_prefill_completed` on its
first token, :meth:`add_output` as tokens stream (output tracking only), :meth:`free` on completion
or cancellation. :meth:`expire` drops requests older than a timeout, in case a free was lost.

It also counts the uncached prompt tokens each worker was sent (:meth:`written_column`): what it has
written into its cache. Other router replicas' requests arrive through :meth:`add` too, so every
replica counts the same writes, from the time it started. A worker the count first meets after the
fleet has written starts at the mean of the others (:meth:`_enrol`).

And it notes, for each worker with prefill queued, since when that queue has waited without a sign
of progress (:meth:`stalled`): the router's only view of an engine that stops (decision 63).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.common.wire.hashing import blocks_needed
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.common.wire.worker_load import WorkerLoad
from kvmesh.router.decode_pace import DecodePace


@dataclass(slots=True)
class _Request:
    worker: WorkerKey
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    prefill_tokens: int
    expected_output: int
    added_at: float
    output_tokens: int = 0
    own_blocks: int = 0
    watched: bool = False  # its prefill keeps the worker's stall clock running (see add)
    first_token_at: float | None = None  # when its first token was seen (None: not yet, or no time given)


@dataclass(slots=True)
class _WorkerLoad:
    requests: int = 0
    prefilling: int = 0  # requests whose prefill is still queued or running
    watched: int = 0  # of those, the ones the stall clock waits on (see add)
    prefill_tokens: int = 0
    own_blocks: int = 0
    block_refs: dict[int, int] = field(default_factory=dict)

    @property
    def decode_blocks(self) -> int:
        return len(self.block_refs) + self.own_blocks


def _active_prefix(block_refs: dict[int, int], block_hashes: Sequence[int]) -> int:
    """How many leading blocks of the request are already active on the worker.

    Every active request contributes its full blocks from the first one on, and a sequence hash names
    a block with its whole prefix, so the active blocks along any request form a prefix of it: the
    boundary is found by bisection instead of one lookup per block.
    """
    n = len(block_hashes)
    if not n or block_hashes[0] not in block_refs:
        return 0
    if block_hashes[-1] in block_refs:
        return n
    low, high = 0, n - 1  # low is active, high is not
    while high - low > 1:
        middle = (low + high) // 2
        if block_hashes[middle] in block_refs:
            low = middle
        else:
            high = middle
    return high


_NO_LOAD = _WorkerLoad()  # read-only stand-in for a worker with nothing in flight


@dataclass(frozen=True, slots=True)
class PotentialColumns:
    """Per worker, in the order asked for, if the request under consideration were sent to it: its
    prefill tokens (queued and this request's uncached ones), decode blocks, and the request's prefix
    counted as held there (``held``, from ``overlaps``: the match per worker it was computed with)."""

    prefills: list[int]
    decodes: list[int]
    held: list[int]
    overlaps: Mapping[WorkerKey, int]


@dataclass(frozen=True)
class PotentialLoad:
    """A worker's load if the request under consideration were sent to it."""

    worker: WorkerKey
    prefill_tokens: int
    decode_blocks: int


class ActiveSequences:
    """In-flight requests per worker. Guarantees: loads return to zero once every request is freed."""

    def __init__(self, block_size: int, track_active_blocks: bool = True, track_output_blocks: bool = False) -> None:
        self.block_size = block_size
        self.track_active_blocks = track_active_blocks
        self.track_output_blocks = track_output_blocks
        self._requests: dict[str, _Request] = {}
        self._loads: dict[WorkerKey, _WorkerLoad] = {}
        self._written: dict[WorkerKey, float] = {}
        # each worker with prefill queued: since when it has waited without a sign of progress (stalled)
        self._waiting: dict[WorkerKey, float] = {}
        # a lower bound of its earliest value: a wait only ever restarts later or ends, so it stays one
        self._earliest_wait = 0.0
        # the mean inter-token latency of the requests that ended on each worker lately
        self.decode_pace = DecodePace()

    def _own_blocks(self, prompt_tokens: int, shared_blocks: int, output_tokens: int) -> int:
        tokens = prompt_tokens + (output_tokens if self.track_output_blocks else 0)
        return blocks_needed(tokens, self.block_size) - shared_blocks

    def add(
        self,
        request_id: str,
        worker: WorkerKey,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlap_blocks: int,
        expected_output_tokens: int = 0,
        now: float = 0.0,
    ) -> None:
        """Record a request routed to ``worker`` (``block_hashes``: its full blocks' sequence hashes)."""
        if request_id in self._requests:
            self.free(request_id)
        prefill = max(0, prompt_tokens - overlap_blocks * self.block_size)
        request = _Request(worker, tuple(block_hashes), prompt_tokens, prefill, expected_output_tokens, now)
        request.own_blocks = self._own_blocks(prompt_tokens, len(request.block_hashes), expected_output_tokens)
        self._requests[request_id] = request
        load = self._loads.setdefault(worker, _WorkerLoad())
        load.requests += 1
        # a prefill of less than a block starts no stall clock: a split request's decode half is one,
        # whose first token waits on its KV's transfer (no part of the prediction), and a prompt cached
        # but for its last partial block is served within a step
        request.watched = prefill >= self.block_size
        if request.watched and not load.watched:  # the queue starts: its clock starts with it
            self._wait_from(worker, now)
        load.watched += request.watched
        load.prefilling += prefill > 0
        load.prefill_tokens += prefill
        load.own_blocks += request.own_blocks
        self._written[worker] = self._enrol(worker) + prefill
        for h in request.block_hashes:
            load.block_refs[h] = load.block_refs.get(h, 0) + 1

    def mark_prefill_completed(self, request_id: str, now: float | None = None) -> None:
        """The request's first token arrived (at ``now``: the worker made progress then)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if now is not None and request.first_token_at is None:
            request.first_token_at = now
        load = self._loads[request.worker]
        if request.prefill_tokens:
            load.prefill_tokens -= request.prefill_tokens
            load.prefilling -= 1
            load.watched -= request.watched
            request.prefill_tokens, request.watched = 0, False
        self._progress(request.worker, load, now)

    def add_output(self, request_id: str, tokens: int) -> None:
        """``tokens`` more output tokens of a request: its own blocks grow past any expected length."""
        request = self._requests.get(request_id)
        if request is None or not self.track_output_blocks:
            return
        request.output_tokens += tokens
        own = self._own_blocks(
            request.prompt_tokens, len(request.block_hashes), max(request.output_tokens, request.expected_output)
        )
        if own != request.own_blocks:
            self._loads[request.worker].own_blocks += own - request.own_blocks
            request.own_blocks = own

    def free(self, request_id: str, now: float | None = None, output_tokens: int = 0) -> None:
        """The request ended; ``now``: when it finished on its worker (progress there), None where it
        was dropped without word from the worker (expired, or its router went silent);
        ``output_tokens``: how many it produced, where its end says (its decode pace is then known)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if now is not None and request.first_token_at is not None and output_tokens > 1:
            itl_ms = (now - request.first_token_at) * 1000.0 / (output_tokens - 1)
            self.decode_pace.ended(request.worker, now, itl_ms)
        load = self._loads[request.worker]
        load.requests -= 1
        load.prefilling -= request.prefill_tokens > 0
        load.watched -= request.watched
        self._progress(request.worker, load, now)
        load.prefill_tokens -= request.prefill_tokens
        load.own_blocks -= request.own_blocks
        for h in request.block_hashes:
            count = load.block_refs[h] - 1
            if count:
                load.block_refs[h] = count
            else:
                del load.block_refs[h]

    def _progress(self, worker: WorkerKey, load: _WorkerLoad, now: float | None) -> None:
        """A request on ``worker`` moved on (at ``now``; None: dropped without word from the worker)."""
        if not load.watched:
            self._waiting.pop(worker, None)
        elif now is not None:
            self._wait_from(worker, now)

    def _wait_from(self, worker: WorkerKey, since: float) -> None:
        self._waiting[worker] = since
        if since < self._earliest_wait:  # a time given out of order (another replica's, a caller's)
            self._earliest_wait = since

    def expire(self, now: float, max_age: float) -> list[str]:
        """Free requests added more than ``max_age`` ago (their free was lost); returns their ids."""
        stale = [r for r, request in self._requests.items() if now - request.added_at > max_age]
        for request_id in stale:
            self.free(request_id)
        return stale

    def remove_worker(self, worker_id: int) -> list[str]:
        """Forget a departed worker and every request that was on it; returns those requests' ids."""
        removed = [r for r, req in self._requests.items() if req.worker[0] == worker_id]
        for request_id in removed:
            del self._requests[request_id]
        for key in [k for k in self._loads if k[0] == worker_id]:
            del self._loads[key]
        for key in [k for k in self._written if k[0] == worker_id]:
            del self._written[key]
        for key in [k for k in self._waiting if k[0] == worker_id]:
            del self._waiting[key]
        self.decode_pace.forget(worker_id)
        return removed

    def load(self, worker: WorkerKey) -> tuple[int, int]:
        """(prefill tokens, decode blocks) currently predicted for ``worker``."""
        load = self._loads.get(worker)
        if load is None:
            return 0, 0
        return load.prefill_tokens, load.decode_blocks if self.track_active_blocks else 0

    def any_waited(self, now: float, longer_than: float) -> bool:
        """Whether some worker's queued prefill has waited more than ``longer_than`` seconds without a
        sign of progress (no first token, no request ending there). One comparison where none has
        since the last call that found one (the common case, on the routing decision's hot path)."""
        if now - self._earliest_wait <= longer_than:
            return False
        self._earliest_wait = min(self._waiting.values(), default=now)
        return now - self._earliest_wait > longer_than

    def stalled(self, now: float, longer_than: float) -> dict[WorkerKey, float]:
        """Each worker whose queued prefill has waited more than ``longer_than`` seconds without a sign
        of progress, with that wait (empty where :meth:`any_waited` says none has).

        A worker serving as predicted shows progress at least once per prefill it runs, so a wait
        longer than its predicted queue says it is slower than predicted, by at least the difference:
        an engine stalled or swamped (see :meth:`RoutingPolicy._overdue`)."""
        if not self.any_waited(now, longer_than):
            return {}
        return {worker: now - since for worker, since in self._waiting.items() if now - since > longer_than}

    def written_column(self, workers: Sequence[WorkerKey]) -> list[float]:
        """Per worker of ``workers``, in their order: the uncached prompt tokens routed to it since this
        picture first met it, plus its start (:meth:`_enrol`; this call enrols a worker it meets here) —
        the blocks it has written into its cache, and so how fast its cache turns over."""
        counts = self._written
        return [counts[worker] if worker in counts else self._enrol(worker) for worker in workers]

    def _enrol(self, worker: WorkerKey) -> float:
        """``worker``'s count, starting it where it has none: at 0 while nothing is counted (a fleet
        starting together), else at the mean of the workers counted.

        Why not 0 for a worker that joins later: the write spread (decision 59) steers mostly new prompts to
        workers written less than the mean, and a joiner counted from 0 stayed below it for the rest of the
        run, so it took those prompts past the cheapest worker long after its empty cache was no longer
        what the rule is for. In the planner's replays, where workers join all the time, that grew the
        prompts-2x pool to 16 workers where 10 had served, and cost the shared trough a third of its
        saving (decision 60)."""
        counts = self._written
        count = counts.get(worker)
        if count is None:
            count = counts[worker] = sum(counts.values()) / len(counts) if counts else 0.0
        return count

    def requests(self, worker: WorkerKey) -> int:
        """Requests in flight on ``worker`` (what SGLang's router calls a worker's load)."""
        load = self._loads.get(worker)
        return load.requests if load is not None else 0

    def requests_column(self, workers: Sequence[WorkerKey]) -> list[int]:
        """:meth:`requests` for each of ``workers``, in their order (the routing decision's hot path:
        at 256 workers a method call each cost a fifth of the default's decision)."""
        get_load = self._loads.get
        return [get_load(worker, _NO_LOAD).requests for worker in workers]

    def decoding(self, worker: WorkerKey) -> int:
        """Requests on ``worker`` past their prefill: each step it spends on another prefill delays
        their next tokens."""
        load = self._loads.get(worker)
        return load.requests - load.prefilling if load is not None else 0

    def potential_loads(
        self,
        workers: Sequence[WorkerKey],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlaps: Mapping[WorkerKey, int],
        expected_output_tokens: int = 0,
    ) -> list[PotentialLoad]:
        """Each worker's (prefill tokens, decode blocks) if this request were added to it."""
        columns = self.potential_columns(workers, block_hashes, prompt_tokens, overlaps, expected_output_tokens)
        return [PotentialLoad(*load) for load in zip(workers, columns.prefills, columns.decodes, strict=True)]

    def potential_columns(
        self,
        workers: Sequence[WorkerKey],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlaps: Mapping[WorkerKey, int],
        expected_output_tokens: int = 0,
        in_flight: bool = False,
    ) -> PotentialColumns:
        """:meth:`potential_loads` as columns in ``workers``' order, without an object per worker (the
        routing decision's hot path: one pass over the workers reads each one's load once).

        ``in_flight``: each worker's match is first raised to the request's leading blocks that a request
        in flight there also has: queued ahead of this one (FCFS) or running, that one computes them
        first, so they are as good as cached by the time this one prefills. An index learns of them
        only once computed, and the short prediction of routed blocks (``--router-predicted-ttl-secs``)
        lapses while a loaded worker's queue is longer than it (docs/decisions/0054). The columns'
        ``overlaps`` are then a new mapping; without it, ``overlaps`` itself."""
        own = self._own_blocks(prompt_tokens, len(block_hashes), expected_output_tokens)
        block_size = self.block_size
        n = len(block_hashes)
        # no request's blocks hold None: a prompt without a full block matches nothing in flight
        first = block_hashes[0] if n else None
        merged = dict(overlaps) if in_flight else overlaps
        get_overlap = overlaps.get
        get_load = self._loads.get
        prefills: list[int] = []
        decodes: list[int] = []
        held: list[int] = []
        add_prefill, add_decode, add_held = prefills.append, decodes.append, held.append
        fresh = n + own  # a worker with none of the request's blocks active adds all of them
        for worker in workers:
            load = get_load(worker, _NO_LOAD)
            refs = load.block_refs
            counted = get_overlap(worker, 0)
            if first in refs:
                active = _active_prefix(refs, block_hashes)
                if in_flight and active > counted:
                    counted = merged[worker] = active
                add_decode(len(refs) + load.own_blocks + fresh - active)
            else:
                add_decode(len(refs) + load.own_blocks + fresh)
            add_held(counted)
            prefill = prompt_tokens - counted * block_size
            add_prefill(load.prefill_tokens + prefill if prefill > 0 else load.prefill_tokens)
        if not self.track_active_blocks:
            decodes = [0] * len(prefills)
        return PotentialColumns(prefills, decodes, held, merged)

    def worker_loads(self) -> list[WorkerLoad]:
        """Every worker with a load entry: requests in flight, prefill tokens, KV tokens held."""
        return [
            WorkerLoad(worker[0], worker[1], load.requests, load.prefill_tokens, load.decode_blocks * self.block_size)
            for worker, load in self._loads.items()
        ]

    def workers(self) -> list[WorkerKey]:
        """Workers with a load entry (possibly zero)."""
        return list(self._loads)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)
