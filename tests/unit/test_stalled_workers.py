"""A worker whose queued prefill waits without progress for longer than predicted is behind its
prediction: kv mode charges it the excess and holds no prefix on it (decision 63)."""

from __future__ import annotations

import random

import pytest

from kvmesh.router.active_sequences import ActiveSequences
from kvmesh.router.load_tracker import LoadTracker
from kvmesh.router.policy import STALL_FLOOR_S, STALLED, Decision, RoutingPolicy
from kvmesh.router.sync_messages import ADD, FREE, PREFILL_DONE, SyncMessage

BLOCK = 16
IDLE, HOLDER = (1, 0), (2, 0)
HASHES = list(range(100, 110))  # 10 blocks; the holder has 8 of them cached


class TestStalled:
    def test_nothing_queued_is_nothing_stalled(self):
        active = ActiveSequences(BLOCK)
        active.add("cached", IDLE, [1], prompt_tokens=BLOCK, overlap_blocks=1, now=1.0)  # nothing to prefill
        assert active.stalled(now=9.0, longer_than=0.0) == {}

    def test_the_clock_starts_with_the_queue_and_progress_restarts_it(self):
        active = ActiveSequences(BLOCK)
        active.add("a", HOLDER, [1, 2], 2 * BLOCK, 0, now=10.0)
        active.add("b", HOLDER, [3, 4], 2 * BLOCK, 0, now=11.0)  # joins a waiting queue: no restart
        assert active.stalled(now=12.0, longer_than=0.0) == {HOLDER: pytest.approx(2.0)}
        assert active.stalled(now=12.0, longer_than=2.5) == {}
        active.mark_prefill_completed("a", now=12.5)  # a first token: the engine moves
        assert active.stalled(now=13.0, longer_than=0.0) == {HOLDER: pytest.approx(0.5)}
        active.add("c", IDLE, [5], BLOCK, 0, now=13.0)
        active.add("decoding", HOLDER, [6], BLOCK, 1, now=13.0)
        active.free("decoding", now=14.0)  # a request ending there is progress too
        assert active.stalled(now=15.0, longer_than=0.0) == {IDLE: pytest.approx(2.0), HOLDER: pytest.approx(1.0)}
        assert active.stalled(now=15.0, longer_than=1.5) == {IDLE: pytest.approx(2.0)}

    def test_a_request_dropped_without_word_from_the_worker_is_no_progress(self):
        active = ActiveSequences(BLOCK)
        active.add("queued", HOLDER, [1], BLOCK, 0, now=0.0)
        active.add("lost", HOLDER, [2], BLOCK, 1, now=0.0)
        active.free("lost")  # expired, or its router went silent
        assert active.stalled(now=4.0, longer_than=0.0) == {HOLDER: pytest.approx(4.0)}

    def test_a_prefill_under_a_block_starts_no_clock(self):
        """A split request's decode half: its KV comes from the prefill worker and only its last
        partial block is computed here, after a transfer the prediction does not include."""
        active = ActiveSequences(BLOCK)
        active.add("decode half", HOLDER, [1, 2], prompt_tokens=2 * BLOCK + 5, overlap_blocks=2, now=0.0)
        assert active.load(HOLDER)[0] == 5 and active.stalled(now=9.0, longer_than=0.0) == {}
        active.add("local", HOLDER, [3], BLOCK, 0, now=9.0)
        active.mark_prefill_completed("decode half", now=10.0)  # its first token is progress all the same
        assert active.stalled(now=11.0, longer_than=0.0) == {HOLDER: pytest.approx(1.0)}

    def test_a_worker_whose_queue_emptied_or_that_left_has_no_stall(self):
        active = ActiveSequences(BLOCK)
        active.add("a", HOLDER, [1], BLOCK, 0, now=0.0)
        active.add("b", IDLE, [2], BLOCK, 0, now=0.0)
        active.mark_prefill_completed("a")
        active.remove_worker(IDLE[0])
        assert active.stalled(now=60.0, longer_than=0.0) == {}


def test_another_replicas_first_token_and_end_are_progress_and_its_silence_is_not():
    tracker = LoadTracker()
    add = SyncMessage(ADD, "r2", "a", HOLDER[0], block_size=BLOCK, block_hashes=(1,), prompt_tokens=2 * BLOCK)
    tracker.apply_remote(add, BLOCK, now=0.0)
    tracker.apply_remote(SyncMessage(ADD, "r2", "b", HOLDER[0], block_size=BLOCK, prompt_tokens=BLOCK), BLOCK, 0.0)
    tracker.apply_remote(SyncMessage(PREFILL_DONE, "r2", "a"), None, now=3.0)
    assert tracker.sequences(BLOCK).stalled(now=4.0, longer_than=0.0) == {HOLDER: pytest.approx(1.0)}
    tracker.apply_remote(SyncMessage(FREE, "r2", "a"), None, now=4.0)
    assert tracker.sequences(BLOCK).stalled(now=4.5, longer_than=0.0) == {HOLDER: pytest.approx(0.5)}
    tracker.apply_remote(SyncMessage(ADD, "r3", "c", HOLDER[0], block_size=BLOCK, prompt_tokens=BLOCK), BLOCK, 4.5)
    tracker.forget_router("r3")  # silent: its request is dropped, and that says nothing of the worker
    assert tracker.sequences(BLOCK).stalled(now=6.0, longer_than=0.0) == {HOLDER: pytest.approx(2.0)}


def decision(now: float, slack: float = 2.0, progress_at: float | None = None) -> Decision:
    """Where a turn of a session the holder holds 8 of 10 blocks of goes at ``now``, the holder
    having had one request queued since time 0 (and its first token at ``progress_at``)."""
    policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=128.0, stall_slack=slack)
    policy.active.add("queued", HOLDER, [900, 901], 2 * BLOCK, 0, now=0.0)
    policy.active.add("behind", HOLDER, [902], BLOCK, 0, now=0.0)
    if progress_at is not None:
        policy.active.mark_prefill_completed("queued", now=progress_at)
    return policy.choose([IDLE, HOLDER], HASHES, 10 * BLOCK, {HOLDER: 8}, now=now)


def choice(now: float, slack: float = 2.0, progress_at: float | None = None) -> tuple[int, int]:
    return decision(now, slack, progress_at).worker


def test_a_holder_within_its_prediction_keeps_the_session():
    assert choice(now=STALL_FLOOR_S / 2) == HOLDER


def test_a_stalled_holder_loses_the_session_to_an_idle_worker():
    assert choice(now=5.0) == IDLE  # 5 s without progress on a queue predicted in milliseconds
    assert choice(now=5.0, slack=0.0) == HOLDER  # off: the prediction trusted, the penalty holds it
    assert choice(now=5.0, progress_at=4.9) == HOLDER  # it moved 0.1 s ago: not behind


def test_a_request_moved_off_a_stalled_worker_says_so():
    assert decision(now=5.0).steered_by == STALLED  # the router logs and counts it
    assert decision(now=STALL_FLOOR_S / 2).steered_by == ""  # kept where the cost alone put it


def test_a_stalled_worker_is_charged_the_excess_among_equals():
    """Two workers holding nothing of the prompt, one with a small queue stalled: the other,
    with a longer queue that moves, is cheaper."""
    stalled, moving = (1, 0), (2, 0)
    policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=128.0, stall_slack=2.0)
    policy.active.add("small", stalled, [900], BLOCK, 0, now=0.0)
    policy.active.add("long", moving, [800 + i for i in range(8)], 8 * BLOCK, 0, now=0.0)
    policy.active.mark_prefill_completed("long", now=9.9)
    policy.active.add("longer", moving, [700 + i for i in range(8)], 8 * BLOCK, 0, now=9.9)
    assert policy.choose([stalled, moving], HASHES, 10 * BLOCK, now=0.1).worker == stalled
    assert policy.choose([stalled, moving], HASHES, 10 * BLOCK, now=10.0).worker == moving


def test_a_new_session_off_a_stalled_holder_still_starts_where_fewer_sessions_are_parked():
    """Off a stalled holder the costs are counted again, the holder holding nothing: the session
    spread's charge (decision 72) is part of what the choice is made on, and no part of the stall bound."""
    near, far = (1, 0), (3, 0)  # near holds 1 block of the prompt: the cheaper by the cost alone

    def first_turn(parked: dict | None) -> Decision:
        policy = RoutingPolicy(
            "kv", BLOCK, rng=random.Random(0), duplicate_penalty=1.0, stall_slack=2.0, session_spread_ms=5.0
        )
        policy.active.add("queued", HOLDER, [900, 901], 2 * BLOCK, 0, now=0.0)
        return policy.choose([near, far, HOLDER], HASHES, 10 * BLOCK, {HOLDER: 8, near: 1}, now=5.0, parked=parked)

    assert first_turn(None).worker == near
    moved = first_turn({near: 3})
    assert moved.worker == far
    assert moved.steered_by == STALLED


def test_no_prefix_is_pulled_from_a_stalled_holder():
    """Off a stalled holder the costs are counted again without pricing any pull, and the decision
    carries none: the longest prefix is the late worker's, and a pull would wait on it."""
    other = (1, 0)
    policy = RoutingPolicy("kv", BLOCK, rng=random.Random(0), duplicate_penalty=1.0, stall_slack=2.0, pull_ratio=1.5)
    for i in range(4):  # a long queue: the holder is far busier than the other worker
        policy.active.add(f"queued {i}", HOLDER, [800 + 10 * i + j for j in range(8)], 8 * BLOCK, 0, now=0.0)
    busy = policy.choose([other, HOLDER], HASHES, 10 * BLOCK, {HOLDER: 8}, now=0.1, pullable=[other, HOLDER])
    assert busy.worker == other and busy.pull is not None and busy.pull.holder == HOLDER  # saturated: pulled
    late = policy.choose([other, HOLDER], HASHES, 10 * BLOCK, {HOLDER: 8}, now=30.0, pullable=[other, HOLDER])
    assert late.worker == other and late.pull is None  # 30 s without progress: late, and nothing pulled
