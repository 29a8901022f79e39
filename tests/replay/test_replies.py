"""Replies cached where they were made in the replay (``--cache-replies``, decision 75's rule offline):
a session's next turn finds its previous reply cached on the worker that served that turn, and only
there; without the rule, no worker holds it."""

from __future__ import annotations

import json

import pytest

from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.replay import cli, session_trace
from kvmesh.replay.config import ReplayConfig
from kvmesh.replay.mooncake_trace import PromptBuilder, TraceRequest
from kvmesh.replay.replies import ReplyCache, reply_contexts
from kvmesh.replay.simulator import ReplaySimulator

SMALL = {"block_size": 16, "trace_block_size": 512, "num_blocks": 4096, "max_num_batched_tokens": 2048}


def chat() -> list[TraceRequest]:
    """Two turns of one session far apart, and another session's turn between them on another prefix.
    Turn 1: system prompt (blocks 0–1) and a message (2); its 600-token reply is blocks 3–4 of turn 2,
    whose own new message is block 5."""
    return [
        TraceRequest(0.0, 3 * 512 - 100, 600, (0, 1, 2), "a"),
        TraceRequest(10.0, 2 * 512, 4, (100, 101), "b"),
        TraceRequest(60_000.0, 6 * 512 - 7, 4, (0, 1, 2, 3, 4, 5), "a"),
    ]


def test_each_continued_turn_maps_to_its_context_through_its_reply():
    generated = session_trace.generate("chat", session_trace.SessionRules(sessions=30, session_rate=1.0, seed=5))
    rows = [
        TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]), r["session_id"])
        for r in generated
    ]
    contexts = reply_contexts(rows)
    assert contexts, "no turn was continued"
    later: dict[str, int] = {}
    for position in reversed(range(len(rows))):
        row = rows[position]
        following = later.get(row.session)
        later[row.session] = position
        if following is None:
            assert position not in contexts
            continue
        nxt = rows[following]
        reply = -(-row.output_length // session_trace.BLOCK)
        assert contexts[position] == nxt.hash_ids[: len(row.hash_ids) + reply]
        assert contexts[position][: len(row.hash_ids)] == row.hash_ids


def test_a_reply_s_blocks_chain_parents_first_as_the_next_turn_s_prompt_hashes_them():
    trace = chat()
    builder = PromptBuilder(512, 16)
    blocks = ReplyCache(trace, builder).blocks(0)
    assert ReplyCache(trace, builder).blocks(1) == [] and ReplyCache(trace, builder).blocks(2) == []
    later = trace[2]
    local = builder.local_hashes(later, builder.tokens(later))
    chained = sequence_hashes(local)
    # the context through the reply: 5 trace blocks of 32 engine blocks, the next turn's first 160
    assert [b[0] for b in blocks] == chained[:160]
    assert [b[1] for b in blocks] == local[:160]
    assert [b[2] for b in blocks] == [None, *chained[:159]]


def replay(**options):
    config = ReplayConfig(**{**SMALL, "workers": 2, **options})
    config.validate()
    simulator = ReplaySimulator(config)
    return simulator, simulator.run(chat())


def test_the_next_turn_finds_its_reply_cached_on_its_worker_only_with_cache_replies():
    credited, records = replay(cache_replies=True)
    plain, without = replay()
    first, later = records[0], records[2]
    assert later.worker == first.worker, "the session's next turn left its worker"
    # turn 1's prompt rounds down to 89 full blocks of 16; turn 2 finds the 160 blocks through the reply
    assert without[2].cached_tokens == (3 * 512 - 100) // 16 * 16
    assert later.cached_tokens == 5 * 512
    assert credited.replies_cached == 160 - (3 * 512 - 100) // 16
    assert plain.replies_cached == 0
    # the other worker holds none of it
    other = credited.engines[1 - first.worker]
    assert other.cached_prefix_tokens(PromptBuilder(512, 16).tokens(chat()[2])) == 0


def test_kvmesh_replay_cache_replies_counts_the_replies_and_credits_them_in_the_bounds(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    rows = [
        {"timestamp": r.timestamp_ms, "input_length": r.input_length, "output_length": r.output_length,
         "hash_ids": list(r.hash_ids), "session_id": r.session}
        for r in chat()
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = [str(path), "--workers", "2", "--block-size", "16", "--trace-block-size", "512"]
    assert cli.main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main([*common, "--cache-replies"]) == 0
    credited = json.loads(capsys.readouterr().out)
    assert "reply_blocks_cached" not in plain
    assert credited["reply_blocks_cached"] == 160 - (3 * 512 - 100) // 16
    assert credited["prefix_reuse"] > plain["prefix_reuse"]
    assert credited["reuse_bounds"]["infinite_cache"] > plain["reuse_bounds"]["infinite_cache"]
    # the one continued turn found all its reply where the bound puts it: the run keeps the bound
    assert credited["prefix_reuse"] == pytest.approx(credited["reuse_bounds"]["fleet_lru"])
