"""What the router's ttft cost knows of each engine instance's step times: pooled where workers
advertise their steps, their own constants where they advertise only those (docs/decisions/0061),
one speed for the workers of one speed class (docs/decisions/0062)."""

from __future__ import annotations

import random

import pytest

from kvmesh.common.core.timing import TimingModel, as_constants, from_constants, scaled
from kvmesh.common.core.timing_fit import TimingFit
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.router.step_times import REFIT_EVERY_S, StepTimes


def evidence(speed: float, steps: int = 500, seed: int = 0) -> dict:
    truth = scaled(TimingModel(), 10.0 * speed)
    rng = random.Random(seed)
    fit = TimingFit(TimingModel())
    for _ in range(steps):
        tokens = rng.choice([0, rng.randint(16, 3000)])
        decoding = tokens == 0 or rng.random() < 0.5
        fit.observe(tokens, 100, 1000, decoding, truth.step_ms(tokens, 100, 1000, decoding) * rng.uniform(0.9, 1.1))
    return fit.evidence().to_wire()


def record(worker_id: int, model: str = "m", **extra) -> InstanceRecord:
    return InstanceRecord("worker", worker_id, f"w{worker_id}", model=model, extra=dict(extra))


class Costed:
    """What ``StepTimes`` applied: each instance's model, and how many times it applied one."""

    def __init__(self) -> None:
        self.timing: dict[WorkerKey, TimingModel] = {}
        self.applied = 0

    def __call__(self, key: WorkerKey, timing: TimingModel) -> None:
        self.timing[key] = timing
        self.applied += 1

    def long_prefill(self, worker_id: int) -> float:
        return self.timing[WorkerKey(worker_id, 0)].prefill_ms(3000)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_workers_that_advertise_their_steps_are_costed_from_the_pool_at_their_own_speed():
    costed = Costed()
    times = StepTimes(costed, clock=Clock())
    times.adopt([record(1, timing_evidence=evidence(1.0, seed=1)), record(2, timing_evidence=evidence(2.0, seed=2))])
    assert costed.long_prefill(2) / costed.long_prefill(1) == pytest.approx(2.0, rel=0.1)


def test_workers_of_one_speed_class_are_costed_at_one_speed_and_other_classes_at_their_own():
    costed = Costed()
    times = StepTimes(costed, clock=Clock())
    # worker 2 measured 1.6x slow (a contended host) but advertises its peers' class; worker 3 is a slower device
    times.adopt(
        [
            record(1, timing_evidence=evidence(1.0, seed=1), speed_class="gpu-a"),
            record(2, timing_evidence=evidence(1.6, seed=2), speed_class="gpu-a"),
            record(3, timing_evidence=evidence(2.0, seed=3), speed_class="gpu-b"),
        ]
    )
    assert costed.long_prefill(1) == pytest.approx(costed.long_prefill(2), rel=1e-9)
    # class a's one speed lies between its workers' own, near their mean
    assert 1.5 < costed.long_prefill(3) / costed.long_prefill(1) < 1.8
    times.adopt([record(2, timing_evidence=evidence(1.6, seed=2, steps=501))])  # no class now: a speed of its own
    times.refit(force=True)
    assert costed.long_prefill(2) / costed.long_prefill(1) == pytest.approx(1.6, rel=0.1)


def test_an_unchanged_record_costs_nothing_and_refits_are_paced_but_a_newcomer_is_costed_at_once():
    costed, clock = Costed(), Clock()
    times = StepTimes(costed, clock=clock)
    first = record(1, timing_evidence=evidence(1.0))
    times.adopt([first])
    assert costed.applied == 1
    times.adopt([first])  # the same record object: nothing to do
    assert costed.applied == 1
    times.adopt([first, record(2, timing_evidence=evidence(1.0, seed=2))])  # a newcomer: refit now
    assert costed.applied == 3 and WorkerKey(2, 0) in costed.timing
    updated = record(1, timing_evidence=evidence(1.0, steps=600))
    times.adopt([updated])  # changed within the refit pace: held
    assert costed.applied == 3
    clock.now += REFIT_EVERY_S
    times.adopt([updated])
    assert costed.applied == 5


def test_a_departed_worker_leaves_the_pool():
    costed, clock = Costed(), Clock()
    times = StepTimes(costed, clock=clock)
    times.adopt([record(1, timing_evidence=evidence(1.0, seed=1)), record(2, timing_evidence=evidence(3.0, seed=2))])
    with_slow = costed.long_prefill(1)
    times.forget(2, [WorkerKey(2, 0)])
    times.refit(force=True)
    # alone in its pool, worker 1 is costed at its own speed, no longer against the slow one's steps
    assert costed.long_prefill(1) != pytest.approx(with_slow, rel=0.01)
    assert costed.long_prefill(1) == pytest.approx(scaled(TimingModel(), 10.0).prefill_ms(3000), rel=0.1)


def test_workers_of_different_models_are_pooled_apart():
    costed = Costed()
    times = StepTimes(costed, clock=Clock())
    times.adopt(
        [
            record(1, "small", timing_evidence=evidence(1.0, seed=1)),
            record(2, "big", timing_evidence=evidence(4.0, seed=2)),
        ]
    )
    # each alone in its pool: costed at its own speed, not at a mean of the two
    assert costed.long_prefill(2) / costed.long_prefill(1) == pytest.approx(4.0, rel=0.1)


def test_constants_alone_and_a_ranks_own_constants_are_used_as_advertised():
    costed = Costed()
    times = StepTimes(costed, clock=Clock())
    slow, slower = as_constants(scaled(TimingModel(), 2.0)), as_constants(scaled(TimingModel(), 3.0))
    ranked = record(2, timing=slow, timing_by_rank={"1": slower}, timing_evidence=evidence(1.0), data_parallel_size=2)
    times.adopt([record(1, timing=slow), ranked])
    assert costed.timing[WorkerKey(1, 0)] == from_constants(slow)
    assert costed.timing[WorkerKey(2, 1)] == from_constants(slower)  # fitted apart: its own
    assert costed.timing[WorkerKey(2, 0)] != from_constants(slow)  # its steps, pooled


def test_unreadable_steps_are_ignored_and_the_last_cost_stays():
    costed, clock = Costed(), Clock()
    times = StepTimes(costed, clock=clock)
    times.adopt([record(1, timing_evidence=evidence(1.0))])
    before = costed.timing[WorkerKey(1, 0)]
    clock.now += REFIT_EVERY_S
    times.adopt([record(1, timing_evidence={"xtx": [1.0], "xty": [], "steps": 1.0})])
    assert costed.timing[WorkerKey(1, 0)] == before


def test_the_ranks_of_one_worker_count_as_that_worker_once_in_the_pool():
    alone, ranked = Costed(), Costed()
    steps = evidence(2.0, seed=2)
    StepTimes(alone, clock=Clock()).adopt(
        [record(1, timing_evidence=evidence(1.0, seed=1)), record(2, timing_evidence=steps)]
    )
    StepTimes(ranked, clock=Clock()).adopt(
        [record(1, timing_evidence=evidence(1.0, seed=1)), record(2, timing_evidence=steps, data_parallel_size=4)]
    )
    # four ranks of one fit weigh in the pool as the one worker does, and are costed alike
    assert ranked.timing[WorkerKey(1, 0)] == alone.timing[WorkerKey(1, 0)]
    assert [ranked.timing[WorkerKey(2, rank)] for rank in range(4)] == [alone.timing[WorkerKey(2, 0)]] * 4
