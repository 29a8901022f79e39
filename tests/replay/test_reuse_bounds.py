"""The most any router could reuse on a trace (kvmesh.replay.bounds), computed by hand on small
traces, and reported beside the reuse by ``kvmesh replay``."""

from __future__ import annotations

import json

import pytest

from kvmesh.replay import cli
from kvmesh.replay.bounds import block_keys, reuse_bounds
from kvmesh.replay.mooncake_trace import TraceRequest

# trace blocks of 64 tokens, engine blocks of 16: 4 engine blocks a hash id
A = TraceRequest(0, 128, 1, (1, 2))  # 8 blocks
B = TraceRequest(1, 128, 1, (1, 3))  # shares A's first 4
C = TraceRequest(2, 128, 1, (1, 2))  # all of A (but its last token)


def test_the_infinite_cache_keeps_every_prefix_and_an_lru_cache_only_what_fits():
    trace = [A, B, C]
    # infinite: B reuses 4 blocks, C 7 (one token is always computed): 11 × 16 of 384 prompt tokens
    assert reuse_bounds(trace, 64, 16, 10**6).infinite == pytest.approx(11 * 16 / 384)
    # 8 blocks of room: after B (its own 4 evict A's last 4, the tail first), C finds 4
    assert reuse_bounds(trace, 64, 16, 8).fleet_lru == pytest.approx((4 + 4) * 16 / 384)
    # no room at all: nothing is reused
    assert reuse_bounds(trace, 64, 16, 0).fleet_lru == 0.0


def test_with_cache_replies_a_turn_s_reply_joins_the_cache_with_it():
    # a session's two turns: the reply of the first (one 64-token block, id 5) opens the second's new
    # part; without the rule no earlier request computed it
    first = TraceRequest(0, 128, 40, (1, 2), "s")
    second = TraceRequest(1, 256, 1, (1, 2, 5, 6), "s")
    total = 128 + 256
    for capacity, without_replies in ((10**6, 8), (12, 8), (8, 8)):
        plain = reuse_bounds([first, second], 64, 16, capacity)
        credited = reuse_bounds([first, second], 64, 16, capacity, cache_replies=True)
        assert plain.fleet_lru == pytest.approx(without_replies * 16 / total)
        # 12 blocks through the reply, when they fit
        assert credited.fleet_lru == pytest.approx((12 if capacity >= 12 else 8) * 16 / total)
    assert reuse_bounds([first, second], 64, 16, 10**6, cache_replies=True).infinite == pytest.approx(12 * 16 / total)


def test_blocks_are_keyed_alike_with_and_without_building_the_prompt():
    """Aligned blocks are named from the hash ids; unaligned ones from the prompt's hashes. Either
    way, two requests share exactly the blocks of their common prefix."""
    for trace_block, block in ((64, 16), (64, 24)):
        a, b = block_keys(A, trace_block, block), block_keys(B, trace_block, block)
        shared = sum(1 for x, y in zip(a, b, strict=False) if x == y)
        assert shared == 64 // block and len(a) == 128 // block


def test_kvmesh_replay_reports_its_reuse_as_a_share_of_the_bounds(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    # a second apart: each request runs alone, so the one worker's cache holds what came before
    rows = [
        {"timestamp": i * 1000, "input_length": 128, "output_length": 1, "hash_ids": list(r.hash_ids)}
        for i, r in enumerate((A, B, C))
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert cli.main([str(path), "--workers", "1", "--block-size", "16", "--trace-block-size", "64"]) == 0
    summary = json.loads(capsys.readouterr().out)
    bounds = summary["reuse_bounds"]
    assert bounds["infinite_cache"] == pytest.approx(11 * 16 / 384)
    assert bounds["reuse_of_fleet_lru"] == pytest.approx(summary["prefix_reuse"] / bounds["fleet_lru"])
    assert 0 < summary["prefix_reuse"] <= bounds["fleet_lru"]
    assert "reuse_bounds" not in json.loads((cli.main([str(path), "--no-reuse-bounds"]), capsys.readouterr().out)[1])
