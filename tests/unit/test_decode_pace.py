"""A worker whose requests' decodes miss the ITL target while another's keep it gets no new session:
the router measures each request's mean inter-token latency from its first token to its end, and a
session's first turn is charged on, and not held by the duplicate penalty at, a worker behind
(decision 67). Later turns stay where their context is."""

from __future__ import annotations

import random

import pytest

from kvmesh.router.active_sequences import ActiveSequences
from kvmesh.router.decode_pace import BEHIND_PENALTY_MS, MIN_REQUESTS, WINDOW_S, DecodePace
from kvmesh.router.policy import DECODES_BEHIND, Decision, RoutingPolicy
from kvmesh.router.session_affinity import SessionAffinity

BLOCK = 16
IDLE, HOLDER = (1, 0), (2, 0)
HASHES = list(range(100, 110))  # 10 blocks; the holder has 4 of them cached (a tenant's prompt)


def ended(pace: DecodePace, worker, now: float, missed: int, kept: int, itl_ms: tuple[float, float] = (80.0, 20.0)):
    for _ in range(missed):
        pace.ended(worker, now, itl_ms[0])
    for _ in range(kept):
        pace.ended(worker, now, itl_ms[1])


class TestDecodePace:
    def test_the_share_counts_the_requests_past_the_target_within_the_window(self):
        pace = DecodePace()
        ended(pace, HOLDER, now=0.0, missed=5, kept=15)
        assert pace.missed_share(HOLDER, now=1.0, target_ms=50.0) == pytest.approx(0.25)
        assert pace.missed_share(HOLDER, now=1.0, target_ms=100.0) == 0.0
        assert pace.missed_share(HOLDER, now=WINDOW_S + 1.0, target_ms=50.0) is None  # they left the window
        ended(pace, IDLE, now=0.0, missed=MIN_REQUESTS - 1, kept=0)
        assert pace.missed_share(IDLE, now=0.0, target_ms=50.0) is None  # too few to tell

    def test_the_counted_misses_follow_samples_in_and_out_of_the_window(self):
        pace = DecodePace()
        ended(pace, HOLDER, now=0.0, missed=5, kept=15)
        assert pace.missed_share(HOLDER, now=1.0, target_ms=50.0) == pytest.approx(0.25)  # counted from here on
        ended(pace, HOLDER, now=15.0, missed=2, kept=18)
        assert pace.missed_share(HOLDER, now=16.0, target_ms=50.0) == pytest.approx(7 / 40)
        assert pace.missed_share(HOLDER, now=WINDOW_S + 5.0, target_ms=50.0) == pytest.approx(2 / 20)  # the first left

    def test_a_worker_is_behind_only_while_another_keeps_pace(self):
        pace = DecodePace()
        ended(pace, HOLDER, now=0.0, missed=5, kept=15)
        ended(pace, IDLE, now=0.0, missed=0, kept=20)
        assert pace.behind([IDLE, HOLDER], now=1.0, target_ms=50.0) == [0.0, BEHIND_PENALTY_MS]
        ended(pace, IDLE, now=0.5, missed=10, kept=0)  # every worker misses: another placement helps nobody
        assert pace.behind([IDLE, HOLDER], now=1.0, target_ms=50.0) is None
        assert pace.behind([(3, 0), HOLDER], now=1.0, target_ms=50.0) == [0.0, BEHIND_PENALTY_MS]  # just joined
        pace.forget(HOLDER[0])  # it left: what it measured goes with it
        assert pace.missed_share(HOLDER, now=1.0, target_ms=50.0) is None

    def test_active_sequences_measure_a_request_from_its_first_token_to_its_end(self):
        active = ActiveSequences(BLOCK)
        active.add("r", HOLDER, [1], BLOCK, 0, now=0.0)
        active.mark_prefill_completed("r", now=1.0)
        active.free("r", now=2.0, output_tokens=11)  # 10 gaps in 1 s: 100 ms each
        assert active.decode_pace.missed_share(HOLDER, 2.0, target_ms=99.0) is None  # one request: too few
        for i in range(MIN_REQUESTS - 1):
            active.add(f"q{i}", HOLDER, [1], BLOCK, 0, now=2.0)
            active.mark_prefill_completed(f"q{i}", now=2.0)
            active.free(f"q{i}", now=2.2, output_tokens=11)  # 20 ms each
        assert active.decode_pace.missed_share(HOLDER, 2.2, target_ms=50.0) == pytest.approx(1 / MIN_REQUESTS)
        assert active.decode_pace.missed_share(HOLDER, 2.2, target_ms=101.0) == 0.0

    def test_an_end_without_its_tokens_or_first_token_measures_nothing(self):
        active = ActiveSequences(BLOCK)
        for i in range(2 * MIN_REQUESTS):
            active.add(f"r{i}", HOLDER, [1], BLOCK, 0, now=0.0)
            if i % 2:
                active.mark_prefill_completed(f"r{i}", now=1.0)
                active.free(f"r{i}", now=5.0)  # the end did not say how many tokens
            else:
                active.free(f"r{i}", now=5.0, output_tokens=10)  # no first token seen: a failure
        assert active.decode_pace.missed_share(HOLDER, 5.0, target_ms=50.0) is None


def decision(new_session: bool, target_ms: float = 50.0) -> Decision:
    """Where a request sharing 4 of its 10 blocks with the holder goes, the holder's recent decodes
    having missed the target in 5 of 20 requests and the idle worker's in none of 20."""
    policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=128.0, itl_target_ms=target_ms)
    ended(policy.active.decode_pace, HOLDER, now=0.0, missed=5, kept=15)
    ended(policy.active.decode_pace, IDLE, now=0.0, missed=0, kept=20)
    return policy.choose([IDLE, HOLDER], HASHES, 10 * BLOCK, {HOLDER: 4}, now=1.0, new_session=new_session)


def choice(new_session: bool, target_ms: float = 50.0) -> tuple[int, int]:
    return decision(new_session, target_ms).worker


def test_a_new_session_starts_where_decodes_keep_pace():
    assert choice(new_session=True) == IDLE


def test_a_session_steered_off_a_worker_behind_says_so():
    assert decision(new_session=True).steered_by == DECODES_BEHIND  # the router logs and counts it
    assert decision(new_session=False).steered_by == ""


def test_a_later_turn_stays_with_its_context_and_the_rule_can_be_turned_off():
    assert choice(new_session=False) == HOLDER  # moving it would rebuild its context elsewhere
    assert choice(new_session=True, target_ms=0.0) == HOLDER  # off: the duplicate penalty holds it


def test_a_session_starts_where_the_router_holds_no_affinity_for_it():
    sessions = SessionAffinity(ttl_s=60.0, credit=1.0)
    assert sessions.starts("s", now=0.0)
    sessions.routed("s", HOLDER, [1, 2], now=0.0)
    assert not sessions.starts("s", now=30.0)
    assert sessions.starts("s", now=61.0)  # its affinity expired: nothing holds it for the session
    assert not sessions.starts("", now=0.0)  # anonymous: no session to start
    assert not SessionAffinity(ttl_s=0.0, credit=0.0).starts("s", now=0.0)  # sessions not kept
