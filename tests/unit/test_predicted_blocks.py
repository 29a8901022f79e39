"""Predict-on-route's store (kvmesh.router.predicted_blocks): leading matches per worker within the
TTL, refreshes, expiry, bounds, and agreement with a brute-force reading of what was recorded."""

from __future__ import annotations

import random

import pytest

from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.router.predicted_blocks import PredictedBlocks

A, B = (1, 0), (2, 0)


def chain(*locals_: int) -> list[int]:
    return sequence_hashes(list(locals_))


def test_a_worker_matches_the_leading_blocks_it_was_sent_until_the_ttl_passes():
    predicted = PredictedBlocks(ttl_s=2.0)
    predicted.record(A, chain(1, 2, 3), now=10.0)
    assert predicted.matches(chain(1, 2, 3, 4), now=11.0) == {A: 3}
    assert predicted.matches(chain(1, 2, 9), now=11.0) == {A: 2}
    assert predicted.matches(chain(9, 2, 3), now=11.0) == {}
    assert predicted.matches(chain(1, 2, 3), now=12.0) == {}


def test_siblings_share_their_prefix_and_keep_their_own_tails():
    predicted = PredictedBlocks(ttl_s=2.0)
    predicted.record(A, chain(1, 2, 3), now=0.0)
    predicted.record(B, chain(1, 2, 4), now=0.5)
    assert predicted.matches(chain(1, 2, 4), now=1.0) == {A: 2, B: 3}
    # A's whole chain lapses at 2.0; B's at 2.5
    assert predicted.matches(chain(1, 2, 4), now=2.2) == {B: 3}


def test_a_refresh_of_a_prefix_outlives_the_older_longer_recording():
    predicted = PredictedBlocks(ttl_s=2.0)
    predicted.record(A, chain(1, 2, 3, 4), now=0.0)
    predicted.record(A, chain(1, 2), now=1.5)
    assert predicted.matches(chain(1, 2, 3, 4), now=2.5) == {A: 2}  # the sweep kept the refreshed prefix
    predicted.record(B, chain(7), now=2.6)  # sweeps the first recording
    assert predicted.matches(chain(1, 2, 3, 4), now=2.7) == {A: 2}


def test_the_oldest_recordings_go_past_the_bound_and_a_departed_worker_goes_at_once():
    predicted = PredictedBlocks(ttl_s=100.0, max_requests=2)
    for i in range(3):
        predicted.record(A, chain(10 + i), now=float(i))
    assert len(predicted) == 2 and predicted.matches(chain(10), now=3.0) == {}
    assert predicted.matches(chain(12), now=3.0) == {A: 1}
    predicted.record(B, chain(12), now=3.0)
    predicted.remove_worker(A[0])
    assert predicted.matches(chain(12), now=3.5) == {B: 1}


@pytest.mark.parametrize("seed", range(5))
def test_matches_agree_with_a_brute_force_reading_of_the_recordings(seed: int):
    rng = random.Random(seed)
    predicted = PredictedBlocks(ttl_s=1.0, max_requests=40)
    recordings: list[tuple[float, tuple[int, int], list[int]]] = []
    now = 0.0
    for _ in range(200):
        now += rng.uniform(0, 0.1)
        blocks = chain(*(rng.randrange(3) for _ in range(rng.randint(1, 6))))  # many shared prefixes
        worker = (rng.randrange(3), 0)
        predicted.record(worker, blocks, now)
        recordings = [*recordings, (now + 1.0, worker, blocks)][-40:]
        query = chain(*(rng.randrange(3) for _ in range(rng.randint(1, 6))))
        expected: dict[tuple[int, int], int] = {}
        for until, holder, held in recordings:
            if until <= now:
                continue
            depth = 0
            while depth < min(len(held), len(query)) and held[depth] == query[depth]:
                depth += 1
            if depth:
                expected[holder] = max(expected.get(holder, 0), depth)
        assert predicted.matches(query, now) == expected
