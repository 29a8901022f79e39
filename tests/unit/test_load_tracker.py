"""The router's load picture through a request's life, its replicas' requests and its housekeeping."""

from __future__ import annotations

from kvmesh.router.load_tracker import LoadTracker, remote_key
from kvmesh.router.sync_messages import ADD, FREE, PREFILL_DONE, SyncMessage

BLOCK = 16
W1, W2 = (1, 0), (2, 0)


def add(tracker: LoadTracker, request_id: str, worker=W1, blocks=(11, 12, 13), prompt=60, overlap=0, now=0.0):
    tracker.add(request_id, worker, BLOCK, list(blocks), prompt, overlap, 0, now)


def test_a_request_adds_prefill_then_only_blocks_then_nothing():
    tracker = LoadTracker()
    picture = tracker.sequences(BLOCK)
    add(tracker, "r", overlap=1)
    assert picture.load(W1) == (60 - 16, 4)  # 3 full blocks + the partial one
    tracker.first_token("r")
    assert picture.load(W1) == (0, 4)
    tracker.free("r")
    assert picture.load(W1) == (0, 0) and len(tracker) == 0
    tracker.free("r")  # a second free is harmless
    tracker.first_token("unknown")


def test_pictures_are_per_block_size():
    tracker = LoadTracker()
    tracker.add("a", W1, 16, [1], 20, 0, 0, 0.0)
    tracker.add("b", W1, 32, [2], 40, 0, 0, 0.0)
    assert tracker.sequences(16).load(W1)[0] == 20 and tracker.sequences(32).load(W1)[0] == 40
    assert len(tracker.pictures()) == 2


def test_other_replicas_requests_are_tracked_apart_and_dropped_with_their_router():
    tracker = LoadTracker()
    picture = tracker.sequences(BLOCK)
    add(tracker, "r")  # ours, with the same id as theirs below
    tracker.apply_remote(SyncMessage(ADD, "other", "r", 2, 0, BLOCK, (21,), 40, 0, 0), BLOCK, now=0.0)
    tracker.apply_remote(SyncMessage(ADD, "other", "s", 2, 0, BLOCK, (22,), 40, 0, 0), BLOCK, now=0.0)
    assert picture.load(W2) == (80, 6)
    tracker.apply_remote(SyncMessage(PREFILL_DONE, "other", "r"), None, now=0.0)
    assert picture.load(W2)[0] == 40
    tracker.apply_remote(SyncMessage(FREE, "other", "r"), None, now=0.0)
    assert picture.load(W2) == (40, 3)
    tracker.forget_router("other")
    assert picture.load(W2) == (0, 0)
    assert picture.load(W1) == (60, 4)  # ours untouched
    assert remote_key("other", "r") not in picture


def test_every_replica_counts_the_writes_another_replica_routed():
    """The write count the default spreads mostly new prompts by (decision 59) is the same on every
    replica: an add from another replica counts its uncached tokens as an own one does, and they stay
    counted after the request and its router are gone (they were written)."""
    ours, theirs = LoadTracker(), LoadTracker()
    add(ours, "r", worker=W2, prompt=60, overlap=1)
    theirs.apply_remote(SyncMessage(ADD, "a", "r", 2, 0, BLOCK, (11, 12, 13), 60, 1, 0), BLOCK, now=0.0)
    theirs.apply_remote(SyncMessage(FREE, "a", "r"), None, now=0.0)
    theirs.forget_router("a")
    assert ours.sequences(BLOCK).written_column([W2]) == theirs.sequences(BLOCK).written_column([W2]) == [60 - BLOCK]


def test_an_add_for_an_unknown_worker_is_ignored():
    tracker = LoadTracker()
    tracker.apply_remote(SyncMessage(ADD, "other", "r", 9, 0, BLOCK, (1,), 40, 0, 0), None, now=0.0)
    assert len(tracker) == 0


def test_expiry_and_worker_removal_free_what_they_drop():
    tracker = LoadTracker()
    picture = tracker.sequences(BLOCK)
    add(tracker, "old", now=0.0)
    add(tracker, "new", worker=W2, now=50.0)
    tracker.apply_remote(SyncMessage(ADD, "other", "x", 2, 0, BLOCK, (5,), 40, 0, 0), BLOCK, now=0.0)
    assert sorted(tracker.expire(now=60.0, max_age=30.0)) == ["old", remote_key("other", "x")]
    assert picture.load(W1) == (0, 0) and len(tracker) == 1
    tracker.remove_worker(2)
    assert len(tracker) == 0 and W2 not in picture.workers()
