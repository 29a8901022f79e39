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


def test_a_turn_close_behind_its_sessions_last_continues_a_loop():
    affinity = SessionAffinity(ttl_s=60.0, credit=0.0)  # kept without a credit: the default
    assert not affinity.continues_loop("s", now=0.0, within_s=10.0)  # a first turn
    affinity.routed("s", (1, 0), [1, 2], now=0.0)
    assert affinity.continues_loop("s", now=4.0, within_s=10.0)  # an agent's next step
    assert not affinity.continues_loop("s", now=25.0, within_s=10.0)  # a person's reply
    assert not affinity.continues_loop("s", now=4.0, within_s=0.0)  # off
    assert not affinity.continues_loop("", now=4.0, within_s=10.0)  # no session named
    assert not affinity.continues_loop("other", now=4.0, within_s=10.0)
    short = SessionAffinity(ttl_s=2.0, credit=0.0)
    short.routed("s", (1, 0), [1], now=0.0)
    assert not short.continues_loop("s", now=3.0, within_s=10.0)  # the session expired first
