"""A request's session: where the facade takes it from (kvmesh.common.wire.session), and the router's
soft, expiring affinity for it (kvmesh.router.session_affinity)."""

from __future__ import annotations

import pytest

from kvmesh.common.wire.session import MAX_SESSION_ID_LENGTH, parse_session, session_of
from kvmesh.router.session_affinity import SessionAffinity


def test_the_body_wins_then_the_headers_in_order_then_the_user():
    headers = {"session-id": "codex", "x-claude-code-session-id": "claude"}
    assert session_of("body", headers, "alice") == "body"
    assert session_of(None, headers, "alice") == "claude"  # Claude Code's header before Codex's
    assert session_of(None, {"x-session-id": "mine", **headers}, "alice") == "mine"
    assert session_of(None, {}, "alice") == "alice"
    assert session_of(None, {}, None) == ""


def test_a_session_id_that_cannot_be_kept_is_refused_naming_its_source():
    assert parse_session("x" * MAX_SESSION_ID_LENGTH)
    with pytest.raises(ValueError, match="x-session-id: a session id is at most 256"):
        session_of(None, {"x-session-id": "x" * 257}, None)
    with pytest.raises(ValueError, match="user: a session id must be printable"):
        session_of(None, {}, "a\nb")


def test_the_affinity_credits_the_last_turns_worker_with_a_share_of_the_shared_prefix():
    affinity = SessionAffinity(ttl_s=60.0, credit=0.5)
    affinity.routed("s", (3, 1), [10, 11, 12, 13], now=0.0)
    # the next turn shares the first three blocks: credited half of them, rounded
    assert affinity.credited("s", [10, 11, 12, 99, 98], now=1.0) == ((3, 1), 2)
    assert affinity.credited("s", [77, 78], now=1.0) is None  # nothing shared: no preference
    assert affinity.credited("other", [10, 11], now=1.0) is None
    assert affinity.credited("s", [10, 11, 12, 13], now=60.0) is None  # expired


def test_the_affinity_follows_the_latest_turn_forgets_departed_workers_and_is_bounded():
    affinity = SessionAffinity(ttl_s=60.0, credit=1.0, max_sessions=2)
    affinity.routed("a", (1, 0), [1, 2], now=0.0)
    affinity.routed("a", (2, 0), [1, 2, 3], now=1.0)  # the latest turn's worker wins
    assert affinity.credited("a", [1, 2, 3], now=2.0) == ((2, 0), 3)
    affinity.routed("b", (1, 0), [5], now=2.0)
    affinity.routed("c", (1, 0), [6], now=3.0)  # a third session: the least recently routed goes
    assert [e.session for e in affinity.live(4.0)] == ["c", "b"]
    affinity.forget_worker(1)
    assert len(affinity) == 0
    off = SessionAffinity(ttl_s=0.0, credit=1.0)
    off.routed("a", (1, 0), [1], now=0.0)
    assert len(off) == 0 and not off.enabled
    kept = SessionAffinity(ttl_s=60.0, credit=0.0)  # kept and shown, not weighed in the cost
    kept.routed("a", (1, 0), [1, 2], now=0.0)
    assert len(kept) == 1 and kept.credited("a", [1, 2], now=1.0) is None


def test_a_second_quick_turn_in_a_row_continues_a_loop():
    affinity = SessionAffinity(ttl_s=60.0, credit=0.0)  # kept without a credit: the default
    assert not affinity.continues_loop("s", now=0.0, within_s=10.0)  # a first turn
    affinity.routed("s", (1, 0), [1, 2], now=0.0)
    assert not affinity.continues_loop("s", now=4.0, within_s=10.0)  # one quick turn: a person's, maybe
    affinity.routed("s", (1, 0), [1, 2, 3], now=4.0)
    assert affinity.continues_loop("s", now=8.0, within_s=10.0)  # quick after quick: an agent's next step
    assert not affinity.continues_loop("s", now=25.0, within_s=10.0)  # a person's reply
    assert not affinity.continues_loop("s", now=6.0, within_s=3.0)  # quick, but the turn before was not
    assert not affinity.continues_loop("s", now=8.0, within_s=0.0)  # off
    assert not affinity.continues_loop("", now=8.0, within_s=10.0)  # no session named
    assert not affinity.continues_loop("other", now=8.0, within_s=10.0)
    affinity.routed("s", (1, 0), [1, 2, 3, 4], now=40.0)  # a person's reply after a pause
    assert not affinity.continues_loop("s", now=44.0, within_s=10.0)  # its quick answer starts no loop
    affinity.routed("s", (2, 0), [1, 2, 3, 4], now=40.5)  # the same turn again (a split's other half)
    assert not affinity.continues_loop("s", now=44.0, within_s=10.0)  # is no quick turn of its own
    short = SessionAffinity(ttl_s=2.0, credit=0.0)
    short.routed("s", (1, 0), [1], now=0.0)
    short.routed("s", (1, 0), [1, 2], now=1.0)
    assert not short.continues_loop("s", now=3.5, within_s=10.0)  # the session expired first


def test_an_anonymous_prompt_that_extends_one_routed_just_before_continues_a_loop():
    from kvmesh.router.loop_turns import LoopTurns

    turns = LoopTurns(within_s=10.0)
    assert not turns.continues([1, 2, 3], now=0.0)  # nothing routed yet
    turns.routed([1, 2], now=0.0)  # an agent's first step: its prompt's full blocks
    assert not turns.continues([1, 2, 3], now=3.0)  # one quick turn: a person's, maybe
    turns.routed([1, 2, 3], now=3.0)  # the next step: the last prompt and more
    assert turns.continues([1, 2, 3, 4], now=6.0)  # quick after quick: a loop
    assert not turns.continues([1, 2, 3], now=6.0)  # the same prompt again: a retry, not a step
    assert not turns.continues([1, 5, 6], now=6.0)  # shares a prefix only: another conversation
    assert not turns.continues([1, 2, 3, 4], now=14.0)  # a person's reply, seconds later
    assert len(turns) == 0  # what lapsed is forgotten
    turns.routed([1, 2, 3], now=14.0)  # a prompt extending one long forgotten
    assert not turns.continues([1, 2, 3, 4], now=15.0)  # starts no loop
    turns.routed([7, 8], now=20.0, cached_blocks=2)  # a system prompt and a message under a block
    turns.routed([7, 8, 9], now=21.0)
    assert not turns.continues([7, 8, 9, 10], now=22.0)  # a prefix many share is nobody's last turn
    off = LoopTurns(within_s=0.0)
    off.routed([1, 2], now=0.0)
    off.routed([1, 2, 3], now=1.0)
    assert len(off) == 0 and not off.continues([1, 2, 3, 4], now=2.0)
    bounded = LoopTurns(within_s=10.0, max_prompts=2)
    for first in (10, 20, 30):
        bounded.routed([first, first + 1], now=0.0)
        bounded.routed([first, first + 1, first + 2], now=0.5)
    assert len(bounded) == 2 and not bounded.continues([10, 11, 12, 13], now=1.0)  # the oldest went first
    assert bounded.continues([30, 31, 32, 33], now=1.0)


def test_a_router_replica_tells_a_loop_turn_from_a_prompt_another_replica_routed():
    """Replica sync's AddRequest carries a request's blocks: the replica that did not route an
    agent's last step still tells its next one (no session named) as a loop turn."""
    import random

    from kvmesh.common.rpc.channels import ChannelPool
    from kvmesh.common.runtime.discovery import InstanceRecord
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.indexer_client import IndexerClient
    from kvmesh.router.routing import RouteInput, Router
    from kvmesh.router.sync_messages import ADD, SyncMessage

    record = InstanceRecord("worker", 1, "127.0.0.1:9001", model="m", block_size=16, capacity_blocks=4096)

    class OneWorker:
        def instances(self) -> list[InstanceRecord]:
            return [record]

        def get(self, instance_id: int) -> InstanceRecord | None:
            return record if instance_id == 1 else None

    def replica(penalty: float) -> Router:
        config = RouterConfig(seed=1, kv_duplicate_penalty=penalty)
        indexers = IndexerClient(None, ChannelPool(), 0.5, random.Random(1))
        return Router(config, OneWorker(), indexers, clock=lambda: 100.0)

    first = list(range(64))  # an agent's first step: 4 blocks of 16
    step = [*first, *range(2000, 2032)]  # its second, seconds later
    next_step = [*step, *range(1000, 1040)]  # the same prompt, the answer and a tool's output appended
    other = replica(4.0)

    def added(prompt: list[int]) -> SyncMessage:
        return SyncMessage(ADD, "a", "r1", 1, 0, 16, tuple(other.prepare(RouteInput("m", prompt)).block_hashes), 64)

    assert not other.loop_turn(other.prepare(RouteInput("m", next_step)), 100.0)  # not told yet
    other.apply_remote(added(first))
    other.apply_remote(added(step))
    assert other.loop_turn(other.prepare(RouteInput("m", next_step)), 101.0)
    without_penalty = replica(0.0)  # only the penalty reads loop turns: nothing is kept for it
    without_penalty.apply_remote(added(first))
    without_penalty.apply_remote(added(step))
    assert not without_penalty.loop_turn(without_penalty.prepare(RouteInput("m", next_step)), 101.0)
