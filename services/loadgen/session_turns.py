"""A session's turns sent as a chat client sends them (``kvmesh bench --cache-replies``): each after
the previous turn's answer, and finding the previous reply cached where it was generated.

In a session-structured trace (:mod:`kvmesh.replay.session_trace`, or any Mooncake trace whose rows
name a ``session_id``), a turn's hash ids are the previous turn's, then the previous reply's, then
the new message's. A live replay sends the trace's text, not what the model generated, and caps
each answer's length; so, left alone, the reply's blocks reach a worker only as part of the next
turn's prompt, and no worker has them cached then. A real reply is decoded on the worker that
served its turn, which keeps its KV (vLLM caches the blocks it decodes): the next turn finds it
there, and only there. :func:`link_turns` marks, on each turn a later turn continues, the text of
that context up to the reply's end (``reply_prompt``); the runner (:mod:`kvmesh.loadgen.runner`)
prefills it, one output token, on the worker named by the turn's ``x-kvmesh-worker-id`` header
(``kvmesh.worker_id`` in the body), whatever the router's policy, and sends the next turn only
after that. A reply takes ``ceil(output_length / 512)`` of the next turn's new hash ids: a reply
joins the context in trace blocks, as the generator's rules say
(:func:`kvmesh.replay.replies.reply_blocks`; ``kvmesh replay --cache-replies`` credits replies the same way).

Every continuation (a turn whose hash ids start with its session's previous turn's) is sent no
earlier than that turn's answer, as a client cannot send a turn before it has read the last reply;
turns that do not continue their predecessor are sent at their own time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvmesh.loadgen.workload import BenchRequest, TracePromptBuilder
from kvmesh.replay.mooncake_trace import TraceRequest
from kvmesh.replay.replies import continuations


def link_turns(
    trace: Sequence[TraceRequest],
    requests: Sequence[BenchRequest],
    builder: TracePromptBuilder,
) -> list[BenchRequest]:
    """``requests`` (one per row of ``trace``, in its order) with each continuation's ``after`` set
    to its predecessor's index and each continued turn's ``reply_prompt`` set to its context through
    the reply (none where the reply has no block). Rows without a session are returned unchanged."""
    if len(trace) != len(requests):
        raise ValueError("one request per trace row is needed to link a session's turns")
    linked = list(requests)
    for previous, position, reply in continuations(trace):
        linked[position] = dataclasses.replace(linked[position], after=linked[previous].index)
        if reply:
            context = trace[position].hash_ids[: len(trace[previous].hash_ids) + reply]
            text, _ = builder.prompt(TraceRequest(0.0, len(context) * builder.block_size, 1, context))
            linked[previous] = dataclasses.replace(linked[previous], reply_prompt=text)
    return linked
