"""Pricing a pull of a saturated holder's prefix (kvmesh.router.prefix_pull, docs/decisions/0070)."""

from __future__ import annotations

import random

from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.router.prefix_pull import Pull, no_pull_to_price, pull_costs

A, B, C = WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(3, 0)
WORKERS = [A, B, C]
BLOCK = 16
PROMPT = 10 * BLOCK
ALL = [True, True, True]


def fleet(queued: list[int], ms_per_token: float):
    """A cost model of a queue of prefill tokens plus this prompt's, at ``ms_per_token``; returns
    (cost_of, each worker's prefill and cost for the overlaps given)."""

    def cost_of(prefills):
        return [p * ms_per_token for p in prefills]

    def priced(overlaps):
        prefills = [q + PROMPT - o * BLOCK for q, o in zip(queued, overlaps, strict=True)]
        return prefills, cost_of(prefills)

    return cost_of, priced


def price(queued, held, ms_per_token=1.0, ms_per_block=1.0, can_pull=ALL, counted=None, ratio=1.5):
    cost_of, priced = fleet(queued, ms_per_token)
    counted = list(held) if counted is None else counted
    prefills, costs = priced(counted)
    return costs, pull_costs(WORKERS, held, counted, costs, prefills, cost_of, BLOCK, ratio, ms_per_block, can_pull)


def test_a_balanced_fleet_keeps_its_prefixes_where_they_are():
    # A holds 8 of 10 blocks and has the same queue as the others: it is the cheapest, nothing moves
    _, priced = price([100, 100, 100], [8, 0, 0])
    assert priced is None


def test_a_saturated_holder_s_prefix_is_priced_as_a_pull_on_the_others():
    costs, (priced, pulls) = price([2000, 10, 50], [8, 2, 0])
    # the holder is unchanged; the others compute 2 blocks after pulling 6 and 8 at 1 ms each
    assert priced == [costs[0], 10 + 2 * BLOCK + 6.0, 50 + 2 * BLOCK + 8.0]
    assert pulls == [None, Pull(A, 2, 6), Pull(A, 0, 8)]


def test_the_holder_is_measured_against_the_others_mean_not_its_own():
    # the holder computes 2 blocks after a queue of 2000 tokens: 2032 ms; each other worker, with the
    # pull, 2 blocks after 42 tokens plus 8 blocks' transfer: 82 ms. 2032 / 82 = 24.8
    assert price([2000, 42, 42], [8, 0, 0], ratio=24.7)[1] is not None
    assert price([2000, 42, 42], [8, 0, 0], ratio=24.8)[1] is None
    # with only one other worker the holder is still measured against it alone
    two = pull_costs(
        WORKERS[:2],
        [8, 0],
        [8, 0],
        [2032.0, 202.0],
        [2032, 202],
        lambda p: [float(x) for x in p],
        BLOCK,
        24.7,
        1.0,
        [True, True],
    )
    assert two is not None and two[1] == [None, Pull(A, 0, 8)]


def test_only_workers_that_move_blocks_pull_and_only_from_one_that_does():
    costs, (priced, pulls) = price([2000, 10, 10], [8, 0, 0], can_pull=[True, True, False])
    assert pulls == [None, Pull(A, 0, 8), None]
    assert priced[2] == costs[2]
    assert price([2000, 10, 10], [8, 0, 0], can_pull=[False, True, True])[1] is None


def test_no_pull_while_a_longer_prefix_is_still_being_built():
    # C is computing (or predicted to hold) 9 blocks: pulling A's 8 would compute the ninth twice
    assert price([2000, 10, 10], [8, 0, 0], counted=[8, 0, 9])[1] is None
    assert price([2000, 10, 10], [8, 0, 0], counted=[8, 0, 8])[1] is not None


def test_a_pull_slower_than_computing_is_not_taken():
    # moving a block takes 50 ms, computing it 16 ms: the others compute
    costs, (priced, pulls) = price([2000, 10, 10], [8, 0, 0], ms_per_block=50.0)
    assert pulls == [None, None, None]
    assert priced == costs


def test_no_cost_rises_and_every_pull_is_cheaper_than_computing():
    rng = random.Random(7)
    for _ in range(500):
        queued = [rng.randrange(0, 3000) for _ in WORKERS]
        held = [rng.randint(0, 10) for _ in WORKERS]
        can_pull = [rng.random() < 0.8 for _ in WORKERS]
        costs, priced = price(queued, held, rng.uniform(0.5, 2), rng.uniform(0.1, 40), can_pull)
        if priced is None:
            continue
        new, pulls = priced
        best = max(held)
        for i, (cost, old, pull, own) in enumerate(zip(new, costs, pulls, held, strict=True)):
            assert cost <= old
            if pull is not None:
                assert cost < old and can_pull[i] and can_pull[held.index(best)]
                assert (pull.first, pull.first + pull.blocks) == (own, best)
            else:
                assert cost == old


def test_the_quick_test_in_tokens_never_turns_away_a_holder_the_cost_calls_saturated():
    # a prefill's time as the ttft model has it: quadratic in the tokens, the same for every worker
    def cost_of(prefills):
        return [4.2e-7 * t * t + 0.0152 * t + 16.5 for t in prefills]

    rng = random.Random(11)
    fired = 0
    for _ in range(2000):
        held = [rng.randint(0, 10) for _ in WORKERS]
        best = max(held)
        if best == 0:
            continue
        prefills = [rng.randrange(0, 40_000) + PROMPT - own * BLOCK for own in held]
        costs = cost_of(prefills)
        ratio, ms_per_block = rng.uniform(1, 6), rng.uniform(0, 0.5)
        h = held.index(best)
        pulled = cost_of([p - (best - own) * BLOCK for p, own in zip(prefills, held, strict=True)])
        pulled = [c + (best - own) * ms_per_block for c, own in zip(pulled, held, strict=True)]
        saturated = costs[h] * 2 > ratio * (sum(pulled) - pulled[h])
        priced = pull_costs(WORKERS, held, held, costs, prefills, cost_of, BLOCK, ratio, ms_per_block, ALL)
        assert (priced is not None) == saturated
        fired += saturated
    assert fired > 50  # the case is exercised


def test_the_test_from_sums_says_no_pull_only_where_pull_costs_prices_none():
    # every candidate can pull, the index's answer sparse and possibly naming a worker that is no candidate
    rng = random.Random(5)
    outcomes = {True: 0, False: 0}
    fleet = [WorkerKey(i, 0) for i in range(6)]
    for _ in range(3000):
        workers = rng.sample(fleet, rng.randint(1, 6))
        cached = {w: rng.randint(1, 10) for w in fleet if rng.random() < 0.5}
        held = [cached.get(w, 0) for w in workers]
        counted = [own + (rng.randint(0, 3) if rng.random() < 0.2 else 0) for own in held]
        prefills = [rng.randrange(0, 20_000) + PROMPT - own * BLOCK for own in counted]
        ratio = rng.choice([0.0, rng.uniform(1, 6)])
        said = no_pull_to_price(workers, cached, counted, prefills, BLOCK, ratio, set(fleet))
        costs = [float(p) for p in prefills]
        priced = pull_costs(
            workers,
            held,
            counted,
            costs,
            prefills,
            lambda p: [float(x) for x in p],
            BLOCK,
            ratio,
            0.0,
            [True] * len(workers),
        )
        if said:
            assert priced is None
        outcomes[said] += 1
    assert outcomes[True] > 1000 and outcomes[False] > 300  # both answers are exercised


def test_the_test_from_sums_leaves_to_pull_costs_what_it_cannot_tell():
    prefills = [5000, PROMPT, PROMPT]  # A holds 8 blocks of the prompt behind a long queue
    # a candidate that cannot pull, or the candidates given as a list: the per-worker lists are needed
    assert not no_pull_to_price(WORKERS, {A: 8}, [8, 0, 0], prefills, BLOCK, 1.5, {A, B})
    assert not no_pull_to_price(WORKERS, {A: 8}, [8, 0, 0], prefills, BLOCK, 1.5, [A, B, C])
    # the longest prefix held by a worker that is no candidate: the candidates' longest is another
    outsider = WorkerKey(9, 0)
    assert not no_pull_to_price(WORKERS, {outsider: 9, A: 8}, [8, 0, 0], prefills, BLOCK, 1.5, {A, B, C, outsider})
    # and a saturated holder is left to be priced
    assert not no_pull_to_price(WORKERS, {A: 8}, [8, 0, 0], prefills, BLOCK, 1.5, {A, B, C})
    assert no_pull_to_price(WORKERS, {A: 8}, [8, 0, 0], [PROMPT - 8 * BLOCK, PROMPT, PROMPT], BLOCK, 1.5, {A, B, C})
