"""Pricing a pull of a saturated holder's prefix (kvmesh.router.prefix_pull, docs/decisions/0070)."""

from __future__ import annotations

import random

from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.router.prefix_pull import Pull, pull_costs

A, B, C = WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(3, 0)
WORKERS = [A, B, C]


def queue_cost(queued_ms: dict[WorkerKey, float], ms_per_block: float):
    """A cost model of a queue plus the blocks left to compute."""

    def cost_with(workers, overlaps):
        return [queued_ms[w] + (10 - overlaps[w]) * ms_per_block for w in workers]

    return cost_with


def test_a_balanced_fleet_keeps_its_prefixes_where_they_are():
    queued = {A: 100.0, B: 100.0, C: 100.0}
    cost_with = queue_cost(queued, 10.0)
    costs = cost_with(WORKERS, {A: 8, B: 0, C: 0})  # A holds 8 of 10 blocks: it is cheapest
    assert pull_costs(WORKERS, [8, 0, 0], costs, cost_with, 1.5, 1.0, set(WORKERS)) is None


def test_a_saturated_holder_s_prefix_is_priced_as_a_pull_on_the_others():
    queued = {A: 2000.0, B: 10.0, C: 50.0}
    cost_with = queue_cost(queued, 10.0)
    costs = cost_with(WORKERS, {A: 8, B: 2, C: 0})
    priced, pulls = pull_costs(WORKERS, [8, 2, 0], costs, cost_with, 1.5, 1.0, set(WORKERS))
    # the holder is unchanged; the others compute 2 blocks after pulling 6 and 8 at 1 ms each
    assert priced == [costs[0], 10.0 + 20.0 + 6.0, 50.0 + 20.0 + 8.0]
    assert pulls == [None, Pull(A, 2, 6), Pull(A, 0, 8)]


def test_only_workers_that_move_blocks_pull_and_only_from_one_that_does():
    queued = {A: 2000.0, B: 10.0, C: 10.0}
    cost_with = queue_cost(queued, 10.0)
    costs = cost_with(WORKERS, {A: 8, B: 0, C: 0})
    priced, pulls = pull_costs(WORKERS, [8, 0, 0], costs, cost_with, 1.5, 1.0, {A, B})
    assert pulls == [None, Pull(A, 0, 8), None]
    assert priced[2] == costs[2]
    assert pull_costs(WORKERS, [8, 0, 0], costs, cost_with, 1.5, 1.0, {B, C}) is None


def test_no_pull_while_a_longer_prefix_is_still_being_built():
    queued = {A: 2000.0, B: 10.0, C: 10.0}
    cost_with = queue_cost(queued, 10.0)
    costs = cost_with(WORKERS, {A: 8, B: 0, C: 0})
    # C is computing (or predicted to hold) 9 blocks: pulling A's 8 would compute the ninth twice
    assert pull_costs(WORKERS, [8, 0, 0], costs, cost_with, 1.5, 1.0, set(WORKERS), [8, 0, 9]) is None
    assert pull_costs(WORKERS, [8, 0, 0], costs, cost_with, 1.5, 1.0, set(WORKERS), [8, 0, 8]) is not None


def test_a_pull_slower_than_computing_is_not_taken():
    queued = {A: 2000.0, B: 10.0, C: 10.0}
    cost_with = queue_cost(queued, 1.0)
    costs = cost_with(WORKERS, {A: 8, B: 0, C: 0})
    # moving a block takes 5 ms, computing it 1 ms: the others compute
    priced, pulls = pull_costs(WORKERS, [8, 0, 0], costs, cost_with, 1.5, 5.0, set(WORKERS))
    assert pulls == [None, None, None]
    assert priced == costs


def test_no_cost_rises_and_every_pull_is_cheaper_than_computing():
    rng = random.Random(7)
    for _ in range(500):
        queued = {w: rng.uniform(0, 3000) for w in WORKERS}
        held = [rng.randint(0, 10) for _ in WORKERS]
        cost_with = queue_cost(queued, rng.uniform(0.5, 20))
        costs = cost_with(WORKERS, dict(zip(WORKERS, held, strict=True)))
        pullable = {w for w in WORKERS if rng.random() < 0.8}
        priced = pull_costs(WORKERS, held, costs, cost_with, 1.5, rng.uniform(0.1, 5), pullable)
        if priced is None:
            continue
        new, pulls = priced
        best = max(held)
        for worker, cost, old, pull, own in zip(WORKERS, new, costs, pulls, held, strict=True):
            assert cost <= old
            if pull is not None:
                assert cost < old and worker in pullable and pull.holder in pullable
                assert (pull.first, pull.first + pull.blocks) == (own, best)
            else:
                assert cost == old
