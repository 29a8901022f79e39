"""The replay's side of the planner: its ticks, and the virtual fleet it resizes (workers start, join
after their start-up, warmed first with ``--join-warmup-blocks``, drain, hand their cache on with
``--shrink-handoff-blocks``, and stop), as a part of :class:`kvmesh.replay.simulator.ReplaySimulator`,
which owns the state it uses (the engines, the routable workers, the router, the index, the timers)."""

from __future__ import annotations

import heapq
import math
from typing import Any

from kvmesh.common.core.timing_fit import TimingFit
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.planner.decision import POOLS, PoolSizes
from kvmesh.planner.load import IntervalObservation
from kvmesh.replay.fleet import IntervalRecorder
from kvmesh.replay.handoff import departure_costs, plan_handoff, plan_warmup
from kvmesh.worker.engines.mock.mock_engine import MockEngine


class ElasticFleet:
    """The planner's ticks and the virtual fleet's changes, for :class:`ReplaySimulator`."""

    # the simulator's state (set in its constructor)
    config: Any
    planner: Any
    fleet: Any
    looks: list[dict[str, float]]
    _interval_start_ms: float

    def _schedule(self, kind: str, at_ms: float, worker: int = -1) -> None:
        heapq.heappush(self._timers, (at_ms, next(self._transfer_seq), kind, worker))

    def _on_timer(self, kind: str, worker: int, now: float, busy: bool) -> None:
        assert self.planner is not None and self.fleet is not None
        if kind == "handoff":
            self._hand_on(worker, now)
            return
        if kind in ("join", "warm"):
            self._join(worker, now, warmed=kind == "warm")
            return
        if kind == "look":
            self._look(now)
            return
        interval_ms = self.config.adjustment_interval * 1000.0
        current = self._pools()
        observation = self._observed(now - interval_ms, now)
        decision = self.planner.step(observation, current)
        self.decisions.append(decision)
        self.steps.append((observation, decision))
        point = {
            "t_s": now / 1000.0,
            "workers": current.total,
            "target": decision.target.total,
            "observed_rate": observation.request_rate,
            "predicted_rate": decision.forecast.request_rate,
            # the forecast is for the interval that workers started now would serve first
            "horizon": 1 + math.ceil(self.planner.worker_startup_s / self.config.adjustment_interval),
        }
        if self.planner.disaggregated:
            point |= {"prefill": current.prefill, "decode": current.decode}
            point |= {"prefill_target": decision.target.prefill, "decode_target": decision.target.decode}
        self.fleet.timeline.append(point)
        for pool in POOLS:
            change = getattr(decision.target, pool) - getattr(current, pool)
            for _ in range(max(change, 0)):
                self._add_worker(pool, now)
            self._shrink(pool, max(-change, 0), now)
        if busy:
            self._schedule("tick", now + interval_ms)
            self._schedule_looks(now)

    def _schedule_looks(self, start_ms: float) -> None:
        """The looks between the decision at ``start_ms`` and the next (``--growth-look-secs``)."""
        self._interval_start_ms = start_ms
        look_ms = self.config.growth_look_secs * 1000.0
        end_ms = start_ms + self.config.adjustment_interval * 1000.0
        at = start_ms + look_ms
        while look_ms and at < end_ms:
            self._schedule("look", at)
            at += look_ms

    def _look(self, now: float) -> None:
        """A look at the interval so far (kvmesh.planner.growth_look): the pools it grows start now."""
        assert self.planner is not None
        partial = self._observed(self._interval_start_ms, now)
        behind = self.planner.look(partial)
        current = self._pools()
        target = self.planner.grow(partial, behind, current) if behind else None
        if target is None:
            return
        self.looks.append({"t_s": now / 1000.0, "workers": current.total, "target": target.total})
        for pool in POOLS:
            for _ in range(getattr(target, pool) - getattr(current, pool)):
                self._add_worker(pool, now)

    def _pools(self) -> PoolSizes:
        """The pools as the virtual connector counts them: started and not draining."""
        assert self.fleet is not None
        return PoolSizes(*(len(self.fleet.live(pool)) for pool in POOLS))

    def _observed(self, start_ms: float, end_ms: float) -> IntervalObservation:
        """The planner's observation of [start_ms, end_ms), as the live planner would make it."""
        recorder = IntervalRecorder(self.config.ttft_target_ms, self.config.itl_target_ms)
        serving = len(self.workers.instances())  # joined, as the live planner counts the registered
        return recorder.observe(self.records, start_ms, end_ms, serving, self.loads.worker_loads())

    def _add_worker(self, pool: str, now: float) -> None:
        assert self.fleet is not None
        index = len(self.engines)
        self.engines.append(MockEngine(self.engine_config))
        self._next_event_id.append(0)
        self._next_host_event_id.append(0)
        if self._fits:
            self._fits.append(TimingFit(self._fits[0].prior))
        if self.config.router_timing == "exact":
            self.router.chooser.set_timing(WorkerKey(index, 0), self.engine_config.timing)
        worker = self.fleet.start(index, pool, now)
        self._schedule("join", worker.joins_ms, index)

    def _requests_on(self, worker: int) -> int:
        """Requests in flight on ``worker``: how the cache moves weigh a worker's load."""
        return self.engines[worker].num_requests

    def _join(self, worker: int, now: float, warmed: bool) -> None:
        """A started worker's start-up is over (or, ``warmed``, its import has arrived): with
        --join-warmup-blocks it first imports the fleet's hottest blocks (kvmesh.replay.handoff), then
        it registers. One drained meanwhile never does."""
        assert self.fleet is not None
        state = self.fleet.workers[worker]
        if state.draining_since_ms is not None:
            self.warmups.pop(worker, None)
            return
        if warmed:
            plan = self.warmups.pop(worker)
            self.warmed += self.engines[worker].adopt_blocks(plan.blocks)
            self.warm_joins[worker] = now
            self._publish_events(worker, now)
        elif self.config.join_warmup_blocks:
            serving = [r.instance_id for r in self.workers.of_role(state.role)]
            plan = plan_warmup(
                serving, self.engines, self._requests_on, self.config.join_warmup_blocks, self.config.kv_transfer_ms,
                self.config.join_warmup_secs * 1000.0, now,
            )  # fmt: skip
            if plan is not None:
                self.warmups[worker] = plan
                self._schedule("warm", plan.arrives_ms, worker)
                return
        self.workers.join(worker, state.role)

    def _shrink(self, pool: str, count: int, now: float) -> None:
        """Drain ``count`` workers of ``pool``; with --shrink-handoff-blocks, those whose departure
        costs least, each handing its hottest blocks on before it stops (kvmesh.replay.handoff)."""
        assert self.fleet is not None
        if count == 0:
            return
        limit = self.config.shrink_handoff_blocks
        costs = departure_costs([r.instance_id for r in self.workers.instances()], self.engines) if limit else None
        for drained in self.fleet.drain(count, pool, now, costs):
            self.workers.leave(drained.index)  # the router sends it nothing more
            survivors = [r.instance_id for r in self.workers.of_role(pool)]
            plan = None
            if drained.joins_ms <= now:  # one not yet joined holds nothing
                plan = plan_handoff(
                    drained.index, survivors, self.engines, self._requests_on, limit, self.config.kv_transfer_ms, now
                )
            if plan is not None:
                self.handoffs[drained.index] = plan
                self._schedule("handoff", plan.arrives_ms, drained.index)
            self._stop_if_drained(drained.index, now)

    def _hand_on(self, source: int, now: float) -> None:
        """A handoff's blocks arrive: cached on the receivers still serving, indexed by their events."""
        plan = self.handoffs.pop(source)
        self.handoff_ends[source] = now
        for receiver, blocks in plan.parts.items():
            if receiver in self.workers:
                self.handed_on += self.engines[receiver].adopt_blocks(blocks)
                self._publish_events(receiver, now)
        self._stop_if_drained(source, now)

    def _stop_if_drained(self, worker: int, now: float) -> None:
        if self.fleet is None or worker >= len(self.fleet.workers):
            return
        state = self.fleet.workers[worker]
        if worker in self.handoffs:
            return  # it stays until its last block is sent
        if any(pull[2] == worker for pull in self._pulls):
            return  # a request routed there waits for its prefix: it stays to serve it
        if state.draining_since_ms is not None and state.stopped_ms is None and not self.engines[worker].has_work():
            state.stopped_ms = now
            # its events still on their way would bring its blocks back after it is gone
            self.index.remove_worker(worker)
            # discovery drops it: the router forgets it in every stage
            self.router.worker_left(self.workers.record(worker, state.role))
