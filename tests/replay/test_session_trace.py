"""Session-structured traces (kvmesh.replay.session_trace): the written rules hold, a seed gives the
same trace, and the replay reads the session fields."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict

import pytest

from kvmesh.replay.mooncake_trace import TraceError, read_trace
from kvmesh.replay.session_trace import BLOCK, SessionRules, generate, main


def sessions_of(rows: list[dict]) -> dict[str, list[dict]]:
    by_session: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_session[row["session_id"]].append(row)
    return by_session


@pytest.mark.parametrize("kind", ["chat", "agent", "mix"])
def test_each_turn_extends_its_sessions_context_after_the_last(kind):
    rows = generate(kind, SessionRules(sessions=60, seed=3))
    assert rows == sorted(rows, key=lambda r: r["timestamp"])
    for turns in sessions_of(rows).values():
        for earlier, later in itertools.pairwise(turns):
            # the whole earlier prompt, its reply and a new message: a strictly longer shared prefix
            assert later["hash_ids"][: len(earlier["hash_ids"])] == earlier["hash_ids"]
            assert len(later["hash_ids"]) > len(earlier["hash_ids"]) and later["timestamp"] >= earlier["timestamp"]
        for row in turns:
            assert (len(row["hash_ids"]) - 1) * BLOCK < row["input_length"] <= len(row["hash_ids"]) * BLOCK
            assert len(row["hash_ids"]) <= SessionRules().max_context_blocks


def test_agents_take_many_short_turns_and_share_their_tenants_tools():
    chats, agents = generate("chat", SessionRules(sessions=80)), generate("agent", SessionRules(sessions=80))
    turns = lambda rows: len(rows) / len(sessions_of(rows))  # noqa: E731
    outputs = lambda rows: sorted(r["output_length"] for r in rows)[len(rows) // 2]  # noqa: E731
    assert turns(agents) > 2 * turns(chats) and outputs(agents) < outputs(chats)
    # the first turns of one tenant's agents share its system prompt and tool list: 8 blocks or more
    firsts = [turns[0]["hash_ids"] for turns in sessions_of(agents).values() if turns[0]["tenant"] == "t0"]
    shared = min(
        next((i for i, (a, b) in enumerate(zip(firsts[0], f, strict=False)) if a != b), len(f)) for f in firsts
    )
    assert len(firsts) > 2 and shared >= 8


def test_a_seed_gives_the_same_trace_and_another_seed_another(tmp_path, capsys):
    assert generate("mix", SessionRules(seed=5)) == generate("mix", SessionRules(seed=5))
    assert generate("mix", SessionRules(seed=5)) != generate("mix", SessionRules(seed=6))
    path = tmp_path / "t.jsonl"
    assert main([str(path), "--kind", "chat", "--sessions", "20", "--seed", "1"]) == 0
    assert "requests in 20 sessions" in capsys.readouterr().out
    trace = read_trace(path)
    assert {r.session for r in trace} == {json.loads(line)["session_id"] for line in path.read_text().splitlines()}
    assert all(r.tenant and r.tenant.startswith("t") for r in trace)


def test_a_session_field_must_be_a_name(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "session_id": ""})
    )
    with pytest.raises(TraceError, match="session_id must be a non-empty string"):
        read_trace(path)
