"""The third stage of a routing decision: the cost and the choice (sans-I/O, clock passed in).

:class:`Chooser` keeps one :class:`~kvmesh.router.policy.RoutingPolicy` per (block size, mode) and
each engine instance's fitted step times, and picks a worker for a whole request, or places a split
request's prefill and decode (:func:`~kvmesh.router.prefill_placement.place_prefill`), from the
candidates, the cache view and the load picture.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire.disagg import PrefixPull
from kvmesh.common.wire.lora import must_load
from kvmesh.common.wire.worker_key import WorkerKey, keys_of
from kvmesh.router.cache_view import CacheView
from kvmesh.router.candidates import Prepared
from kvmesh.router.config import RoutingOptions
from kvmesh.router.load_tracker import LoadTracker
from kvmesh.router.policy import RoutingPolicy
from kvmesh.router.prefill_job import LocalPrefill, RemotePrefill
from kvmesh.router.prefill_placement import place_prefill
from kvmesh.router.prefix_pull import Pull
from kvmesh.router.scheduler import PerWorkerTtftCost, make_cost_model
from kvmesh.router.step_times import StepTimes

# Assumed when a worker does not advertise its step token budget.
DEFAULT_MAX_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class Choice:
    """The worker chosen for a whole request, its cached prefix there and the prompt's block hashes;
    ``dp_rank``: its data-parallel rank chosen (None: the worker picks, for a request that named
    the worker but no rank); ``steered_by``: see :class:`~kvmesh.router.policy.Decision`;
    ``pull``: the prefix it pulls from ``pull_from`` before computing the rest (None: none)."""

    worker: InstanceRecord
    overlap_blocks: int
    block_hashes: list[int]
    dp_rank: int | None = 0
    steered_by: str = ""
    pull: Pull | None = None
    pull_from: InstanceRecord | None = None

    @property
    def cached_blocks(self) -> int:
        """The prompt's blocks the worker holds once its pull is in: what it does not compute."""
        return max(self.overlap_blocks, self.pull.first + self.pull.blocks) if self.pull else self.overlap_blocks

    def pull_order(self) -> PrefixPull | None:
        """What the worker is told to pull (None: nothing)."""
        if self.pull is None or self.pull_from is None:
            return None
        pulled = self.block_hashes[self.pull.first : self.pull.first + self.pull.blocks]
        return PrefixPull(self.pull_from.instance_id, self.pull_from.address, pulled)

    @property
    def key(self) -> WorkerKey:
        return WorkerKey(self.worker.instance_id, self.dp_rank or 0)


class Chooser:
    """Guarantees: a choice is among the keys it is given; a worker's fitted step times cost each of
    its ranks as that rank advertises them, and leave with the worker."""

    def __init__(
        self,
        options: RoutingOptions,
        loads: LoadTracker,
        rng: random.Random,
        prior: TimingModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``prior``: the step times a worker is costed with until it advertises its own (default:
        the nominal model); ``clock``: paces the refits of pooled step times."""
        self.options = options
        self.loads = loads
        self.prior = prior
        self._rng = rng
        self._policies: dict[tuple[int, str], RoutingPolicy] = {}  # by (block size, mode)
        self.step_times = StepTimes(self.set_timing, prior, clock)
        self._timings: dict[WorkerKey, TimingModel] = {}  # set by set_timing, for policies made later

    def policies(self) -> list[RoutingPolicy]:
        return list(self._policies.values())

    def policy(self, worker: InstanceRecord, mode: str | None = None) -> RoutingPolicy:
        """The policy in ``mode`` (default: ``--router-mode``; ``direct`` chooses as ``kv`` among the
        candidates) of workers shaped like ``worker`` (same block size). Policies of one block size
        share its load picture.

        The cost model takes the engine shape (capacity, step token budget) from the first worker of
        that block size it meets: a fleet serving one model is assumed homogeneous."""
        options = self.options
        mode = mode or ("kv" if options.router_mode == "direct" else options.router_mode)
        policy = self._policies.get((worker.block_size, mode))
        if policy is None:
            cost_model = make_cost_model(
                options.kv_cost,
                worker.block_size,
                int(worker.extra.get("max_num_batched_tokens", DEFAULT_MAX_BATCHED_TOKENS)),
                worker.capacity_blocks,
                self.prior,
            )
            policy = self._policies[(worker.block_size, mode)] = RoutingPolicy(
                mode,
                worker.block_size,
                options.kv_overlap_score_weight,
                options.router_temperature,
                self._rng,
                cost_model,
                active=self.loads.sequences(worker.block_size),
                cache_aware=options.cache_aware_options(),
                moe_score_weight=options.moe_score_weight,
                duplicate_penalty=options.kv_duplicate_penalty,
                write_spread=options.kv_write_spread,
                stall_slack=options.kv_stall_slack,
                itl_target_ms=options.kv_itl_target_ms,
                pull_ratio=options.kv_pull_ratio,
                pull_ms_per_token=options.kv_pull_ms_per_token,
                session_spread_ms=options.session_spread_ms,
            )
            if isinstance(cost_model, PerWorkerTtftCost):
                for key, timing in self._timings.items():
                    cost_model.set_timing(key, timing)
        return policy

    def adopt_timing(self, records: Iterable[InstanceRecord]) -> None:
        """Each rank's advertised step times into the ttft cost of every policy
        (:class:`~kvmesh.router.step_times.StepTimes`)."""
        if self.options.kv_cost == "ttft":
            self.step_times.adopt(records)

    def set_timing(self, key: WorkerKey, timing: TimingModel) -> None:
        """Cost ``key`` with these step times from now on (what the replay's workers know exactly or
        have fitted), in every ttft policy."""
        self._timings[key] = timing
        for policy in self._policies.values():
            if isinstance(policy.cost_model, PerWorkerTtftCost):
                policy.cost_model.set_timing(key, timing)

    def choose(
        self,
        prepared: Prepared,
        view: CacheView,
        keys: Sequence[WorkerKey],
        *,
        commit: bool = True,
        now: float = 0.0,
        loop_turn: bool = False,
        new_session: bool = False,
        parked: Mapping[WorkerKey, int] | None = None,
    ) -> Choice:
        """The cheapest of ``keys`` for the whole request ``prepared``; a ``loop_turn`` (a session's turn
        close behind its last) is not charged the duplicate penalty; a ``new_session``'s first turn avoids
        workers whose decodes are behind, and those where more sessions are ``parked``
        (:meth:`RoutingPolicy.choose`)."""
        request = prepared.request
        policy = self.policy(prepared.candidates[0])
        decision = policy.choose(
            keys,
            prepared.block_hashes,
            prepared.prompt_tokens,
            view.matched,
            view.tree_sizes,
            request.overlap_score_weight,
            request.temperature,
            request.expected_output_tokens,
            tokens=prepared.tokens if policy.needs_tokens else None,
            now=now,
            commit=commit,
            moe_hosted=view.moe_hosted,
            load_tokens=self.adapter_loads(prepared.candidates, request.lora),
            duplicate_penalty=0.0 if loop_turn else None,
            new_session=new_session,
            parked=parked,
            # a named session's context is its own: pulled, the session moves with it, where an
            # anonymous shared prefix would be copied for good (decision 71)
            pullable=prepared.tables.pullable if policy.pull_ratio and request.session else (),
            cached=view.cached,
        )
        worker_id, rank = decision.worker
        pull = decision.pull
        return Choice(
            prepared.by_id[worker_id],
            decision.overlap_blocks,
            prepared.block_hashes,
            rank,
            decision.steered_by,
            pull,
            prepared.by_id[pull.holder.worker_id] if pull else None,
        )

    def place(
        self,
        prepared: Prepared,
        view: CacheView,
        decode_keys: Sequence[WorkerKey],
        pool: Sequence[InstanceRecord],
        *,
        busy: Callable[[WorkerKey], bool],
        split_overhead_ms: float | None,
        enforce: bool,
        now: float,
        loop_turn: bool = False,
    ) -> LocalPrefill | RemotePrefill:
        """Where a request prefills while prefill workers exist (see prefill_placement.py).
        ``split_overhead_ms`` None: split whenever the rules allow (``--disagg-split-when always``).
        A ``loop_turn`` is not charged the duplicate penalty, as in :meth:`choose`.
        Raises :class:`~kvmesh.router.prefill_placement.NoCapacity` when ``enforce`` leaves no choice."""
        options, request = self.options, prepared.request
        decode_policy = self.policy(prepared.candidates[0], options.decode_policy)
        prefill_policy = self.policy(prepared.candidates[0], options.prefill_policy)
        self.adopt_timing(pool)  # prefill workers are costed too
        placement = place_prefill(
            decode_policy,
            decode_keys,
            [WorkerKey(r.instance_id, 0) for r in pool],  # a worker's KV handoff is its first rank's
            prepared.block_hashes,
            prepared.prompt_tokens,
            view.matched,
            view.tree_sizes,
            min_uncached_tokens=options.disagg_min_uncached_tokens,
            prefill_queue_limit_tokens=options.prefill_queue_limit_tokens,
            enforce=enforce,
            overlap_score_weight=request.overlap_score_weight,
            temperature=request.temperature,
            expected_output_tokens=request.expected_output_tokens,
            busy=busy,
            prefill_policy=prefill_policy,
            tokens=prepared.tokens if decode_policy.needs_tokens or prefill_policy.needs_tokens else None,
            now=now,
            moe_hosted=view.moe_hosted,
            split_overhead_ms=split_overhead_ms,
            duplicate_penalty=0.0 if loop_turn else None,
        )
        decode_id, decode_rank = placement.decode
        decode = prepared.by_id[decode_id]
        if placement.prefill is None:
            return LocalPrefill(decode, placement.overlap, prepared.block_hashes, placement.reason, decode_rank)
        prefill_id, prefill_rank = placement.prefill
        prefill = next(r for r in pool if r.instance_id == prefill_id)
        return RemotePrefill(
            prefill,
            placement.overlap,
            decode,
            prepared.block_hashes,
            placement.predicted_prefill_ms,
            prefill_rank,
            decode_rank,
        )

    def adapter_loads(self, workers: Sequence[InstanceRecord], lora: str | None) -> dict[WorkerKey, int]:
        """``--lora-load-tokens`` for each (worker, rank) that must load the request's adapter first."""
        cost = self.options.lora_load_tokens
        if lora is None or not cost:
            return {}
        return {key: cost for r in workers if must_load(r.extra, lora) for key in keys_of(r.instance_id, r.extra)}

    def worker_left(self, record: InstanceRecord) -> None:
        """Forget every rank of a departed worker."""
        keys = list(keys_of(record.instance_id, record.extra))
        self.step_times.forget(record.instance_id, keys)
        for key in keys:
            self._timings.pop(key, None)
            for policy in self._policies.values():
                policy.forget(key)
                if isinstance(policy.cost_model, PerWorkerTtftCost):
                    policy.cost_model.forget(key)
