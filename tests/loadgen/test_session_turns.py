"""Linking a session trace's turns (``kvmesh bench --cache-replies``): each continuation waits for
its session's previous turn, whose reply prompt is the continuation's context through that reply."""

from __future__ import annotations

import math

import pytest

from kvmesh.common.core.tiny_model import MODEL_DIR
from kvmesh.frontend.tokenizer import ModelTokenizer
from kvmesh.loadgen.session_turns import link_turns
from kvmesh.loadgen.workload import TracePromptBuilder, trace_workload
from kvmesh.replay import session_trace
from kvmesh.replay.mooncake_trace import TraceRequest

BLOCK = 32


@pytest.fixture(scope="module")
def builder() -> TracePromptBuilder:
    return TracePromptBuilder(ModelTokenizer(MODEL_DIR), BLOCK)


def as_requests(rows: list[dict]) -> list[TraceRequest]:
    return [
        TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]), r.get("session_id"))
        for r in rows
    ]


def test_every_later_turn_waits_for_the_last_and_the_last_carries_the_context_through_its_reply(builder):
    rules = session_trace.SessionRules(sessions=12, session_rate=2.0, seed=5)
    trace = as_requests(session_trace.generate("mix", rules))
    linked = link_turns(trace, trace_workload(trace, builder, 1.0, 16), builder)
    previous: dict[str, int] = {}
    continuations = 0
    for position, row in enumerate(trace):
        before = previous.get(row.session)
        previous[row.session] = position
        if before is None:
            assert linked[position].after is None
            continue
        continuations += 1
        assert linked[position].after == linked[before].index
        reply = math.ceil(trace[before].output_length / session_trace.BLOCK)
        through = len(trace[before].hash_ids) + reply
        expected = [i for h in row.hash_ids[:through] for i in builder.block(h)[1]]
        assert builder.tokenizer.encode(linked[before].reply_prompt) == expected
    assert continuations > 12
    last_turns = set(previous.values())
    assert all(linked[p].reply_prompt == "" for p in last_turns)


def test_rows_that_do_not_continue_their_session_or_name_none_are_left_alone(builder):
    trace = [
        TraceRequest(0, 64, 600, (1, 2), "s"),
        TraceRequest(10, 96, 4, (9, 2, 3), "s"),  # same session, another context: not a continuation
        TraceRequest(20, 64, 4, (1, 2)),  # no session
        TraceRequest(30, 160, 4, (9, 2, 3, 4, 5), "s"),  # continues the second: one reply block
    ]
    linked = link_turns(trace, trace_workload(trace, builder, 1.0, 16), builder)
    assert [r.after for r in linked] == [None, None, None, 1]
    assert linked[0].reply_prompt == "" and linked[2].reply_prompt == ""
    assert builder.tokenizer.encode(linked[1].reply_prompt) == [i for h in (9, 2, 3, 4) for i in builder.block(h)[1]]
    with pytest.raises(ValueError, match="one request per trace row"):
        link_turns(trace, trace_workload(trace, builder, 1.0, 16)[:2], builder)
