"""What the router's ttft cost knows of each engine instance's step times (sans-I/O, clock passed in).

Workers advertise the constants they fitted and the steps they fitted them on
(:mod:`kvmesh.common.wire.step_timing`). Where the steps are advertised, the workers of one model
are costed with the fit of all their steps together, each scaled to its speed
(:mod:`kvmesh.common.core.fleet_timing`, docs/decisions/0061): one speed for the workers of one
speed class, fitted to their steps together (docs/decisions/0062). A worker that advertises only
constants, or its ranks' own, is costed with those as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import structlog

from kvmesh.common.core.fleet_timing import fleet_models
from kvmesh.common.core.timing import TimingModel, from_constants
from kvmesh.common.core.timing_fit import TimingEvidence
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire.step_timing import SPEED_CLASS_KEY, TIMING_EVIDENCE_KEY, advertised_timing, fitted_apart
from kvmesh.common.wire.worker_key import WorkerKey, keys_of

log = structlog.get_logger(__name__)

# A model's pool is refitted at most this often (its workers advertise every few seconds each, and a
# refit re-costs them all), and at once when a worker joins it.
REFIT_EVERY_S = 1.0


class StepTimes:
    """Guarantees: every instance that advertised readable step times is costed (through ``apply``)
    with them, pooled with its model's other workers where its worker advertised its steps (a
    worker counts once in its pool, whatever its ranks; the workers of a pool that advertise one
    speed class are costed at one speed); a departed worker leaves its pool (:meth:`forget`)."""

    def __init__(
        self,
        apply: Callable[[WorkerKey, TimingModel], None],
        prior: TimingModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``apply``: cost an instance with these step times; ``prior``: what a pooled fit is pulled
        toward (default: the nominal model), as each worker's own fit is."""
        self._apply = apply
        self._prior = prior or TimingModel()
        self._clock = clock
        self._read: dict[int, dict] = {}  # each worker's record extra last read
        self._seen: dict[object, object] = {}  # by worker id (its steps) or WorkerKey (constants): last adopted
        self._pools: dict[str, dict[int, TimingEvidence]] = {}  # by model served, then worker id
        # worker id -> its pool, its ranks costed, the speed class it advertised (None: none)
        self._pooled: dict[int, tuple[str, tuple[WorkerKey, ...], str | None]] = {}
        self._stale: set[str] = set()  # pools changed since their last refit
        self._refitted: dict[str, float] = {}

    def adopt(self, records: Iterable[InstanceRecord]) -> None:
        """Each worker's advertised step times. A request pays an identity check per worker (at 256
        workers 18 µs on the 2-core machine; the check per rank before it, 0.5 ms); a cost is rebuilt
        only when what was advertised really changed."""
        for record in records:
            extra = record.extra
            if self._read.get(record.instance_id) is extra:
                continue  # discovery replaces a record on every update: the same object says nothing new
            self._read[record.instance_id] = extra
            wire = extra.get(TIMING_EVIDENCE_KEY)
            shared: list[WorkerKey] = []  # ranks costed with the worker's one fit
            own: list[WorkerKey] = []  # ranks that advertise their own constants
            for key in keys_of(record.instance_id, extra):
                (own if fitted_apart(extra, key.dp_rank) else shared).append(key)
            if wire is not None and shared:
                if self._changed(record.instance_id, wire):
                    try:
                        evidence = TimingEvidence.from_wire(wire)
                        speed_class = extra.get(SPEED_CLASS_KEY)
                        speed_class = speed_class if isinstance(speed_class, str) and speed_class else None
                        self.observe(record.model, record.instance_id, evidence, tuple(shared), speed_class)
                    except (KeyError, TypeError, ValueError):
                        log.warning("ignoring unreadable step times", worker_id=record.instance_id)
            else:
                own.extend(shared)
                self._leave_pool(record.instance_id)
            for key in own:
                constants = advertised_timing(extra, key.dp_rank)
                if constants is not None and self._changed(key, constants):
                    try:
                        self._apply(key, from_constants(constants))
                    except (KeyError, TypeError, ValueError):
                        log.warning("ignoring unreadable step times", worker_id=record.instance_id, rank=key.dp_rank)
        self.refit()

    def _changed(self, what: object, advertised: object) -> bool:
        seen = self._seen.get(what)
        if seen is advertised:
            return False
        self._seen[what] = advertised
        return seen != advertised

    def observe(
        self,
        model: str,
        worker_id: int,
        evidence: TimingEvidence,
        keys: tuple[WorkerKey, ...],
        speed_class: str | None = None,
    ) -> None:
        """``worker_id``'s steps so far, in the pool of the workers serving ``model``, costing
        ``keys`` (its ranks that share the fit), at the speed of its ``speed_class`` (None: a speed
        of its own); applied at the next :meth:`refit` that is due."""
        if worker_id in self._pooled and self._pooled[worker_id][0] != model:
            self._leave_pool(worker_id)
        pool = self._pools.setdefault(model, {})
        if worker_id not in pool:
            self._refitted.pop(model, None)  # a newcomer is costed from its first advertisement
        pool[worker_id] = evidence
        self._pooled[worker_id] = (model, keys, speed_class)
        self._stale.add(model)

    def refit(self, force: bool = False) -> None:
        """Re-cost the workers of each changed pool, where its last refit is :data:`REFIT_EVERY_S`
        old (``force``: now)."""
        if not self._stale:
            return
        now = self._clock()
        for model in list(self._stale):
            last = self._refitted.get(model)
            if not force and last is not None and now - last < REFIT_EVERY_S:
                continue
            self._stale.discard(model)
            self._refitted[model] = now
            pool = self._pools.get(model, {})
            classes = {worker_id: self._pooled[worker_id][2] for worker_id in pool if self._pooled[worker_id][2]}
            for worker_id, timing in fleet_models(pool, self._prior, speed_classes=classes).items():
                for key in self._pooled[worker_id][1]:
                    self._apply(key, timing)

    def forget(self, worker_id: int, keys: Iterable[WorkerKey]) -> None:
        """A departed worker: out of its pool (the others are refitted without its steps)."""
        self._read.pop(worker_id, None)
        self._seen.pop(worker_id, None)
        for key in keys:
            self._seen.pop(key, None)
        self._leave_pool(worker_id)

    def _leave_pool(self, worker_id: int) -> None:
        pooled = self._pooled.pop(worker_id, None)
        if pooled is not None:
            model = pooled[0]
            self._pools[model].pop(worker_id, None)
            if not self._pools[model]:
                del self._pools[model]
            self._stale.add(model)
