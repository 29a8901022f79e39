"""A new session starts where fewer sessions are parked (docs/decisions/0072): the router counts, per
worker, the sessions whose last turn went there within a minute, and charges a session's first turn
for each beyond the candidates' mean."""

from __future__ import annotations

import random

import pytest

from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.router.policy import RoutingPolicy
from kvmesh.router.session_affinity import PARKED_WITHIN_S, SessionAffinity, parked_charges

BLOCK = 16
A, B, C = WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(3, 0)


def test_a_session_is_parked_on_its_last_turns_worker_for_a_minute():
    affinity = SessionAffinity(ttl_s=600.0, credit=0.0)
    affinity.routed("a", A, [1], now=0.0)
    affinity.routed("b", A, [2], now=10.0)
    affinity.routed("c", B, [3], now=20.0)
    assert dict(affinity.parked(30.0)) == {A: 2, B: 1}
    affinity.routed("a", B, [1, 4], now=40.0)  # its next turn moved the session
    assert dict(affinity.parked(41.0)) == {A: 1, B: 2}
    assert dict(affinity.parked(10.0 + PARKED_WITHIN_S)) == {B: 2}  # b's last turn is a minute old
    assert dict(affinity.parked(20.0 + PARKED_WITHIN_S)) == {B: 1}  # and c's
    affinity.forget_worker(B.worker_id)
    assert dict(affinity.parked(41.0)) == {}


def test_parked_sessions_are_bounded_as_the_affinity_is():
    affinity = SessionAffinity(ttl_s=5.0, credit=0.0, max_sessions=2)
    for i, session in enumerate("abc"):
        affinity.routed(session, A, [i], now=float(i))
    assert dict(affinity.parked(2.0)) == {A: 2}  # the least recently routed session went
    assert dict(affinity.parked(6.5)) == {A: 1}  # with a 5 s ttl, parked no longer than that
    off = SessionAffinity(ttl_s=0.0, credit=0.0)  # sessions not kept: none parked
    off.routed("a", A, [1], now=0.0)
    assert dict(off.parked(0.0)) == {}


def test_only_sessions_beyond_the_candidates_mean_are_charged():
    assert parked_charges([A, B, C], {A: 4, B: 1}, 5.0) == [pytest.approx(5.0 * (4 - 5 / 3)), 0.0, 0.0]
    assert parked_charges([A, B], {A: 2, B: 2, C: 9}, 5.0) == [0.0, 0.0]  # C is no candidate
    assert parked_charges([A, B], {}, 5.0) == [0.0, 0.0]


def first_turn(spread_ms: float, parked: dict[WorkerKey, int] | None) -> WorkerKey:
    """Where a 4-block prompt goes when A holds its first block and both workers are idle (block cost:
    A costs 3 blocks of prefill, B 4)."""
    policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), session_spread_ms=spread_ms)
    return policy.choose([A, B], [10, 11, 12, 13], 4 * BLOCK, {A: 1}, parked=parked).worker


def test_a_new_session_starts_where_fewer_sessions_are_parked():
    assert first_turn(5.0, None) == A  # a later turn, or no session: the cost alone
    assert first_turn(5.0, {A: 3, B: 1}) == B  # one session beyond the mean outweighs a block
    assert first_turn(5.0, {A: 2, B: 2}) == A  # as many parked on each: nothing charged
    assert first_turn(0.0, {A: 3, B: 1}) == A  # off
