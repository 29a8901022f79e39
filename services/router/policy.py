"""The routing decision for one block size and mode, without I/O: the router service and
``kvmesh replay`` both drive this class, so what the replay measures is what the service does.

It reads the load picture (:class:`ActiveSequences`) and owns its mode's selector. Given the
candidate workers, the request's block hashes and, in KV mode, each worker's cached overlap and tree
size (cache-aware mode: its tokens), it returns the chosen worker.

Modes: ``kv`` (cost of cache overlap against predicted load), ``round-robin``, ``random``,
``power-of-two`` (two random workers, the lower predicted load wins) and ``cache-aware`` (SGLang's
policy: a tree of what was sent where, no KV events).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.router.active_sequences import ActiveSequences
from kvmesh.router.cache_aware import CacheAwareOptions, CacheAwareSelector
from kvmesh.router.prefix_pull import Pull, no_pull_to_price, pull_costs
from kvmesh.router.scheduler import (
    BlockCost,
    Candidate,
    CostModel,
    KvSelector,
    PowerOfTwoSelector,
    RandomSelector,
    RoundRobinSelector,
)
from kvmesh.router.session_affinity import parked_charges

POLICY_MODES = ("kv", "round-robin", "random", "power-of-two", "cache-aware")
# a worker's prefill queue may wait this long beyond its slack before it counts as stalled: an engine
# step's granularity and a report's way back, beside a prediction of a few milliseconds
STALL_FLOOR_S = 0.25


STALLED = "stalled"
DECODES_BEHIND = "decodes behind"


@dataclass(frozen=True)
class Decision:
    """The chosen worker and its cached blocks. ``steered_by``: why the worker the cost alone rated
    cheapest was not chosen, where a charge for being late moved the request (:data:`STALLED`, or
    :data:`DECODES_BEHIND` for a session's first turn); empty otherwise. ``pull``: the prefix the
    worker pulls from another before it computes the rest (None: it computes what it lacks)."""

    worker: WorkerKey
    overlap_blocks: int
    steered_by: str = ""
    pull: Pull | None = None


class RoutingPolicy:
    """Chooses workers in one of :data:`POLICY_MODES`."""

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
        cache_aware: CacheAwareOptions | None = None,
        moe_score_weight: float = 0.5,
        duplicate_penalty: float = 0.0,
        write_spread: float = 0.0,
        stall_slack: float = 0.0,
        itl_target_ms: float = 0.0,
        pull_ratio: float = 0.0,
        pull_ms_per_token: float = 0.0,
        session_spread_ms: float = 0.0,
    ) -> None:
        """``cost_model`` defaults to Dynamo's block cost; the service and replay pass the one configured.
        ``active`` is the load picture to read (a :class:`LoadTracker`'s for this block size); by
        default the policy keeps its own. ``cache_aware``: that mode's options (SGLang's defaults).
        ``duplicate_penalty``: kv mode charges a worker this many extra prefill blocks for each block of
        the prompt's prefix that the best-placed candidate holds and it does not (0: off).
        ``write_spread``: with the penalty on, a mostly new prompt goes to a worker written less than this
        share of the candidates' mean where one is predicted within ``balance_rel_threshold`` times the
        cheapest (:meth:`_spread_writes`; 0: off). ``stall_slack``: kv mode charges a worker whose queued
        prefill has waited without progress longer than this many times its predicted cost plus
        :data:`STALL_FLOOR_S` the excess, and lets no penalty hold a prefix there (:meth:`_overdue`; 0: off).
        ``itl_target_ms``: a new session's first turn is charged on, and not held by the penalty at, a worker
        whose decodes are behind this target while another's keep it (:meth:`DecodePace.behind`; 0: off).
        ``pull_ratio``: where the best-placed holder costs more than this many times the other candidates' mean
        with a pull, a worker that can may pull its prefix instead, at ``pull_ms_per_token``
        (:func:`~kvmesh.router.prefix_pull.pull_costs`; 0: off). ``session_spread_ms``: kv mode charges a new
        session's first turn this much at a worker for each session parked there beyond the candidates' mean
        (:func:`~kvmesh.router.session_affinity.parked_charges`; 0: off)."""
        if mode not in POLICY_MODES:
            raise ValueError(f"unknown routing mode {mode!r}")
        self.mode = mode
        self.block_size = block_size
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self.moe_score_weight = moe_score_weight
        self.duplicate_penalty = duplicate_penalty
        self.write_spread = write_spread
        self.stall_slack = stall_slack
        self.itl_target_ms = itl_target_ms
        self.pull_ratio = pull_ratio
        self.pull_ms_per_block = pull_ms_per_token * block_size
        self.session_spread_ms = session_spread_ms
        self._rng = rng or random.Random()
        self.active = (
            active if active is not None else ActiveSequences(block_size, track_active_blocks, track_output_blocks)
        )
        self.cost_model = cost_model or BlockCost(block_size)
        self._kv = KvSelector(self.cost_model, self._rng)
        self._round_robin = RoundRobinSelector()
        self._random = RandomSelector(self._rng)
        self._power_of_two = PowerOfTwoSelector(self._rng)
        self.cache_aware = CacheAwareSelector(cache_aware, self._rng) if mode == "cache-aware" else None
        self._balance = cache_aware or CacheAwareOptions()

    @property
    def needs_overlaps(self) -> bool:
        return self.mode == "kv"

    @property
    def needs_tokens(self) -> bool:
        """Whether :meth:`choose` needs the prompt's tokens (cache-aware mode's tree holds them)."""
        return self.cache_aware is not None

    def forget(self, worker: WorkerKey) -> None:
        """A worker left: cache-aware mode drops what it remembered sending there."""
        if self.cache_aware is not None:
            self.cache_aware.forget(worker)

    def _charge_duplicates(
        self,
        prefills: Sequence[int],
        held: Sequence[int],
        penalty: float,
        overdue: Sequence[float] | None = None,
    ) -> list[int]:
        """``prefills`` plus, per worker, the duplicate penalty's tokens: the blocks of the prefix the
        best-placed candidate holds beyond this worker's (``held``: each one's, in the same order), times
        the penalty. A worker with ``overdue`` time is not counted as a holder: a stalled holder holds
        nothing soon.

        Why: the cost compares only this request's time to first token, so under load it copies a
        prefix to an idle worker whenever the copy costs less than the queue; the copy then evicts
        other prefixes there, and later requests pay for them (docs/decisions/0048)."""
        if overdue is not None:
            best = max((own for own, late in zip(held, overdue, strict=True) if not late), default=0)
            held = [min(own, best) for own in held]
        else:
            best = max(held)
        if best == 0:
            return list(prefills)
        tokens_per_block = penalty * self.block_size
        if float(tokens_per_block).is_integer():  # the usual case: the same sums without a round() each
            whole = int(tokens_per_block)
            return [prefill + (best - own) * whole for prefill, own in zip(prefills, held, strict=True)]
        return [prefill + round((best - own) * tokens_per_block) for prefill, own in zip(prefills, held, strict=True)]

    def _overdue(self, workers: Sequence[WorkerKey], costs: Sequence[float], now: float) -> list[float] | None:
        """Per candidate, in ms, how far its prefill queue's wait without progress at ``now``
        (:meth:`ActiveSequences.stalled`) exceeds ``stall_slack`` times its predicted cost (``costs``, ms)
        plus :data:`STALL_FLOOR_S`; None when no candidate's does.

        Why: the cost trusts the prediction, and the duplicate penalty holds a prefix on its holder
        whatever its queue. Live on vLLM an engine stalled for seconds while the router kept sending its
        sessions' turns there, each of which waited 5–7 s (docs/perf, 2026-11-30). A worker that serves
        as predicted shows progress at least once per predicted queue, so the excess is a lower bound on
        how far behind it is."""
        slack, floor_ms = self.stall_slack, STALL_FLOOR_S * 1000.0
        if not self.active.any_waited(now, STALL_FLOOR_S):
            return None
        # no worker waiting less than the floor plus slack times the cheapest cost can be late: under
        # load, where every queue waits longer than the floor, only the few that might be are read
        stalls = self.active.stalled(now, STALL_FLOOR_S + slack * min(costs) / 1000.0)
        if not stalls:
            return None
        late: list[float] | None = None
        for i, worker in enumerate(workers):
            stall = stalls.get(worker)
            if stall is None:
                continue
            excess = stall * 1000.0 - slack * costs[i] - floor_ms
            if excess > 0:
                if late is None:
                    late = [0.0] * len(workers)
                late[i] = excess
        return late

    def _behind(self, workers: Sequence[WorkerKey], now: float) -> list[float] | None:
        """Per candidate, the charge for decodes behind ``itl_target_ms`` while another's keep it
        (:meth:`DecodePace.behind`), for a session's first turn: such a worker holds no prefix for it
        either. None when no candidate is behind.

        Why only a first turn: a session's later turns find their context on its worker, and moving one
        rebuilds it elsewhere. Moving every turn off a worker whose decodes missed cost the chat families
        4-11% of their reuse and four times the held-out chats' median; steering only new sessions left
        every family as it was and still brought the mix trough to its goal (0.985). The planner's
        session mix had grown its fleet to 7 while one worker, holding every session, missed its ITL
        target (docs/decisions/0067)."""
        return self.active.decode_pace.behind(workers, now, self.itl_target_ms)

    def _imbalanced(self, workers: Sequence[WorkerKey]) -> bool:
        """Whether the candidates' requests in flight are imbalanced by cache-aware's test (the most
        exceeds the fewest by ``balance_abs_threshold`` and by ``balance_rel_threshold`` times). The
        duplicate penalty is waived then: it holds a prefix on its holder whatever the holder's load,
        and a worker that joined a fleet whose holders hold every prefix got nothing while they
        overflowed (the planner's tenant-mix replay grew to 11 workers, one serving; decision 56)."""
        loads = self.active.requests_column(workers)
        return self._balance.imbalanced(max(loads), min(loads))

    def _poorly_matched(self, overlaps: Mapping[WorkerKey, int], prompt_tokens: int) -> bool:
        """Whether the best-placed candidate holds no more than cache-aware's ``cache_threshold`` of
        the prompt (not a hit by cache-aware's own test): then the duplicate penalty is waived and the
        prompt goes where it is computed soonest. Why: a mostly new prompt is a long prefill, and a
        holder computing it delays every request queued or arriving there meanwhile (live on vLLM each
        1,000 tokens of prefill that joins a request's batches adds about as much to its time to first
        token as 1,000 of its own); the prefix it would keep there is a small part of it (decision 58)."""
        best = max(overlaps.values(), default=0)
        return not self._balance.hit(best * self.block_size, prompt_tokens)

    def _spread_writes(
        self,
        workers: Sequence[WorkerKey],
        costs: Sequence[float],
        overlaps: Mapping[WorkerKey, int],
        cheapest: int,
        moe_hosted: Mapping[WorkerKey, float],
    ) -> int:
        """The index of the worker a mostly new prompt goes to: the least-written
        (:meth:`ActiveSequences.written_column`) of the under-written candidates, those written less than
        ``write_spread`` times the candidates' mean,
        that hold at least as much of it (and host as much of its MoE experts) as the ``cheapest`` and whose
        cost is within ``balance_rel_threshold`` times its; ``cheapest`` where there is none.

        Why: the default places a mostly new prompt by load alone, and on a fleet whose caches hold a few
        prompts each the worker that serves a hot prefix's hits, busy with them, is then rarely written: its
        cache stands still while the others' turn over the faster. Live on vLLM the default's cached share
        followed how evenly it wrote the workers, and cache-aware, which sends a miss to the smallest tree,
        writes them evenly (decision 59). Only the under-written are steered, so a fleet written about evenly
        is placed by cost as before."""
        written = self.active.written_column(workers)
        below = self.write_spread * sum(written) / len(written)
        limit = costs[cheapest] * self._balance.balance_rel_threshold
        held = overlaps.get(workers[cheapest], 0)
        hosted = moe_hosted.get(workers[cheapest], 0.0)
        under = [
            i
            for i, count in enumerate(written)
            if count < below
            and costs[i] <= limit
            and overlaps.get(workers[i], 0) >= held
            and moe_hosted.get(workers[i], 0.0) >= hosted
        ]
        if not under:
            return cheapest
        return min(under, key=lambda i: (written[i], costs[i]))

    def predicted_load(self, worker: WorkerKey) -> float:
        """The router's prediction of ``worker``'s load now: the cost model on its queued prefill
        and active blocks (what power-of-two compares)."""
        prefill_tokens, decode_blocks = self.active.load(worker)
        return self.cost_model.cost(Candidate(worker, prefill_tokens, decode_blocks), self.overlap_score_weight)

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
        *,
        tokens: bytes | None = None,
        now: float = 0.0,
        commit: bool = True,
        moe_hosted: Mapping[WorkerKey, float] | None = None,
        load_tokens: Mapping[WorkerKey, int] | None = None,
        duplicate_penalty: float | None = None,
        new_session: bool = False,
        pullable: Collection[WorkerKey] = (),
        cached: Mapping[WorkerKey, int] | None = None,
        parked: Mapping[WorkerKey, int] | None = None,
    ) -> Decision:
        """Pick a worker (per-request weight / temperature override the defaults when given).

        Cache-aware mode needs ``tokens`` (:func:`~kvmesh.common.wire.hashing.token_bytes` of the
        prompt) and ``now`` (seconds); ``commit=False`` keeps it from recording the choice.
        ``moe_hosted``: per worker, the share of the request's MoE experts its cached blocks were
        computed with; in kv mode it waives that share × ``moe_score_weight`` of the worker's cost.
        ``load_tokens``: per worker, prefill tokens it must spend first (a LoRA adapter to load); kv
        mode adds them to its prefill. ``duplicate_penalty``: this request's, where it is not the policy's
        (0 for a turn that continues a loop). ``new_session``: the request starts a session; kv mode then
        charges workers whose decodes are behind ``itl_target_ms`` (:meth:`_behind`). ``pullable``: the workers
        whose engines move cached blocks, between which a prefix may be pulled (``pull_ratio``); ``cached``: what
        each holds in device memory as the index reports it, nothing predicted or credited (what a pull can
        bring; default: ``overlaps``). ``parked``: for a session's first turn, the sessions parked on each worker
        (:meth:`SessionAffinity.parked`), which kv mode charges at ``session_spread_ms`` each beyond the mean."""
        if not workers:
            raise ValueError("no candidate workers")
        if self.mode == "round-robin":
            return Decision(self._round_robin.select(workers), 0)
        if self.mode == "random":
            return Decision(self._random.select(workers), 0)
        if self.mode == "power-of-two":
            return Decision(self._power_of_two.select(workers, self.predicted_load), 0)
        if self.cache_aware is not None:
            if tokens is None:
                raise ValueError("cache-aware routing needs the prompt's tokens")
            in_flight = dict(zip(workers, self.active.requests_column(workers), strict=True))
            choice = self.cache_aware.select(workers, tokens, in_flight, now, commit)
            return Decision(choice.worker, choice.matched_tokens // self.block_size)
        overlaps = overlaps or {}
        # what the workers hold now: a pull brings no block predicted, credited or still being computed
        cached = overlaps if cached is None else cached
        tree_sizes = tree_sizes or {}
        penalty = self.duplicate_penalty if duplicate_penalty is None else duplicate_penalty
        if penalty and self._imbalanced(workers):
            penalty = 0.0
        # holding prefixes where they are: where they are about to be counts too
        columns = self.active.potential_columns(
            workers, block_hashes, prompt_tokens, overlaps, expected_output_tokens, in_flight=bool(penalty)
        )
        overlaps, prefills, decodes, held = columns.overlaps, columns.prefills, columns.decodes, columns.held
        mostly_new = bool(penalty) and self._poorly_matched(overlaps, prompt_tokens)
        if mostly_new:
            penalty = 0.0
        if load_tokens:
            prefills = [prefill + load_tokens.get(worker, 0) for worker, prefill in zip(workers, prefills, strict=True)]
        charging = bool(penalty and overlaps)
        charged = self._charge_duplicates(prefills, held, penalty) if charging else prefills
        weight = self.overlap_score_weight if overlap_score_weight is None else overlap_score_weight
        costs = self.cost_model.costs(workers, charged, decodes, weight)
        pulls: list[Pull | None] | None = None
        if self.pull_ratio and pullable and cached:
            priced = self._priced_pulls(workers, cached, overlaps, held, costs, prefills, decodes, weight, pullable)
            if priced is not None:
                costs, pulls = priced
        # the stall bound is a multiple of the predicted cost: the session spread's preference is no part of it
        stalled = self._overdue(workers, costs, now) if self.stall_slack else None
        behind = self._behind(workers, now) if new_session and self.itl_target_ms else None
        overdue = _summed(stalled, behind)
        cheapest = -1
        if overdue is not None:  # rare: cost again, the late charged for and held by nobody
            cheapest = min(range(len(costs)), key=costs.__getitem__)
            if charging:
                charged = self._charge_duplicates(prefills, held, penalty, overdue)
                costs = self.cost_model.costs(workers, charged, decodes, weight)
                # these costs price no pull, so none is made: the longest prefix is mostly the late
                # worker's, and pulled again from it the held-out agent loops' p99 rose by half
                pulls = None
            costs = [cost + late for cost, late in zip(costs, overdue, strict=True)]
        if parked and self.session_spread_ms:
            charges = parked_charges(workers, parked, self.session_spread_ms)
            costs = [cost + charge for cost, charge in zip(costs, charges, strict=True)]
        discounts = None
        if moe_hosted and self.moe_score_weight:
            discounts = {worker: self.moe_score_weight * share for worker, share in moe_hosted.items()}
        index = self._kv.pick(
            workers, costs, tree_sizes, self.temperature if temperature is None else temperature, discounts
        )
        if mostly_new and self.write_spread:
            index = self._spread_writes(workers, costs, overlaps, index, moe_hosted or {})
        chosen = workers[index]
        steered_by = ""
        if overdue is not None and index != cheapest and overdue[cheapest] > 0:
            steered_by = STALLED if stalled is not None and stalled[cheapest] > 0 else DECODES_BEHIND
        return Decision(chosen, overlaps.get(chosen, 0), steered_by, pulls[index] if pulls else None)

    def _priced_pulls(
        self,
        workers: Sequence[WorkerKey],
        cached: Mapping[WorkerKey, int],
        overlaps: Mapping[WorkerKey, int],
        counted: list[int],
        costs: list[float],
        prefills: list[int],
        decodes: list[int],
        weight: float,
        pullable: Collection[WorkerKey],
    ) -> tuple[list[float], list[Pull | None]] | None:
        """:func:`~kvmesh.router.prefix_pull.pull_costs` on this policy's cost model; ``prefills`` the
        uncharged ones ``costs`` were computed from, with ``overlaps`` (``counted``: each worker's, in
        ``workers``' order)."""
        # the usual case, told from the sparse answers alone: nothing cached, or a longer prefix in flight
        best = max(cached.values(), default=0)
        if best == 0 or max(overlaps.values(), default=0) > best:
            return None
        if no_pull_to_price(workers, cached, counted, prefills, self.block_size, self.pull_ratio, pullable):
            return None
        get_cached = cached.get
        held = [get_cached(worker, 0) for worker in workers]
        can_pull = [worker in pullable for worker in workers]

        def cost_of(pulled_prefills: list[int]) -> list[float]:
            return self.cost_model.costs(workers, pulled_prefills, decodes, weight)

        return pull_costs(
            workers,
            held,
            counted,
            costs,
            prefills,
            cost_of,
            self.block_size,
            self.pull_ratio,
            self.pull_ms_per_block,
            can_pull,
        )


def _summed(first: list[float] | None, second: list[float] | None) -> list[float] | None:
    """Two optional per-candidate charges added; None when neither is given."""
    if first is None or second is None:
        return first if second is None else second
    return [a + b for a, b in zip(first, second, strict=True)]
