"""Replies cached where they were made (``kvmesh replay --cache-replies``, decision 75's rule offline).

In a session-structured trace (:mod:`kvmesh.replay.session_trace`) a turn's hash ids are the
previous turn's, then the previous reply's, then the new message's. A real reply is decoded on the
worker that served its turn, and that worker keeps its KV (vLLM caches the blocks it decodes), so the
next turn finds the reply cached there and only there. The mock engine decodes letters of its own,
whose blocks no later prompt names; left alone, the replay credits no policy for keeping a session
where its replies are. With this rule, when a turn that a later turn of its session continues ends,
the blocks of its context through the reply are cached on its worker as if decoded there (those it
holds already are skipped; room is made by evicting its least recently used blocks), and the
worker's KV events tell the index, as a live worker's would.

A reply takes ``ceil(output_length / 512)`` of the next turn's new hash ids, as the generator's
rules say (:func:`reply_blocks`). A turn that arrives before its predecessor has ended finds nothing
of the reply, as no client could have sent it then.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.replay.mooncake_trace import PromptBuilder, TraceRequest
from kvmesh.replay.session_trace import BLOCK

Block = tuple[int, int, int | None]  # (sequence hash, local hash, parent sequence hash), as engines adopt them


def reply_blocks(previous: TraceRequest, turn: TraceRequest) -> int | None:
    """How many of ``turn``'s hash ids after ``previous``'s are ``previous``'s reply; None when
    ``turn`` does not continue ``previous`` (its hash ids do not start with ``previous``'s)."""
    if turn.hash_ids[: len(previous.hash_ids)] != previous.hash_ids:
        return None
    new = len(turn.hash_ids) - len(previous.hash_ids)
    return min(new, math.ceil(previous.output_length / BLOCK))


def continuations(trace: Sequence[TraceRequest]) -> Iterator[tuple[int, int, int]]:
    """``(previous, position, reply)`` for each row (by position) that continues its session's
    previous row: where the previous is, and how many of the row's hash ids after the previous
    turn's are its reply (:func:`reply_blocks`; it may be 0). Rows without a session continue none."""
    latest: dict[str, int] = {}
    for position, row in enumerate(trace):
        if not row.session:
            continue
        previous = latest.get(row.session)
        latest[row.session] = position
        reply = reply_blocks(trace[previous], row) if previous is not None else None
        if previous is not None and reply is not None:
            yield previous, position, reply


def reply_contexts(trace: Sequence[TraceRequest]) -> dict[int, tuple[int, ...]]:
    """For each row (by position) that a later turn of its session continues, with a reply of at
    least one block: the hash ids of its context through that reply."""
    return {
        previous: tuple(trace[position].hash_ids[: len(trace[previous].hash_ids) + reply])
        for previous, position, reply in continuations(trace)
        if reply
    }


class ReplyCache:
    """The blocks each continued turn's reply leaves on its worker, in the engine's own block terms.
    Guarantees: :meth:`blocks` lists a context's whole engine blocks, parents first, each naming its
    parent, as :meth:`~kvmesh.worker.engines.mock.block_manager.BlockManager.adopt` takes them."""

    def __init__(self, trace: Sequence[TraceRequest], builder: PromptBuilder) -> None:
        self._contexts = reply_contexts(trace)
        self._builder = builder

    def blocks(self, position: int) -> list[Block]:
        """The blocks of row ``position``'s context through its reply (none: no later turn continues it)."""
        context = self._contexts.get(position)
        if context is None:
            return []
        request = TraceRequest(0.0, len(context) * self._builder.trace_block_size, 1, context)
        local = self._builder.local_hashes(request, self._builder.tokens(request))
        chained = sequence_hashes(local)
        return [(chained[i], local[i], chained[i - 1] if i else None) for i in range(len(local))]
