"""What prefix reuse is possible at all on a trace, for reading a router's reuse as a share of it.

Two bounds, each a pass over the trace in arrival order with no engine, no load and no routing:

- **infinite cache**: every block ever computed stays cached, so a request reuses the longest
  prefix any earlier request computed (only a cold start is lost);
- **fleet-wide LRU**: one cache as large as the whole fleet's (``workers`` × ``num_blocks``), its
  blocks evicted least recently used first, a chain's tail before its head (as vLLM and the mock
  engine evict). It is what perfect placement with no load balance could keep: a router that sends
  each request where its prefix is cannot keep more than one shared cache of the same size.

Reuse is counted as the engine counts it: whole blocks, at most all but the prompt's last token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.replay.mooncake_trace import PromptBuilder, TraceRequest
from kvmesh.replay.replies import reply_contexts


@dataclass(frozen=True)
class ReuseBounds:
    infinite: float  # reuse with every block ever computed kept
    fleet_lru: float  # reuse of one LRU cache holding the fleet's blocks

    def as_dict(self, reuse: float) -> dict[str, float]:
        """The bounds, and ``reuse`` as a share of each."""
        return {
            "infinite_cache": self.infinite,
            "fleet_lru": self.fleet_lru,
            "reuse_of_fleet_lru": reuse / self.fleet_lru if self.fleet_lru else 0.0,
            "reuse_of_infinite_cache": reuse / self.infinite if self.infinite else 0.0,
        }


class _Cache:
    """A block cache for the bound: ``capacity`` None keeps everything."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[object, None] = OrderedDict()

    def cached_prefix(self, hashes: Sequence[object]) -> int:
        held = 0
        for block in hashes:
            if block not in self._blocks:
                break
            held += 1
        return held

    def use(self, hashes: Sequence[object]) -> None:
        """The request's blocks were used: each becomes the most recent, its head most of all, so a
        chain's tail goes first."""
        blocks = self._blocks
        for block in reversed(hashes):
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)


def block_keys(request: TraceRequest, trace_block_size: int, block_size: int) -> list:
    """One key per full engine block of ``request``'s prompt, equal between two requests exactly
    where their blocks (and so their prefixes) are equal. Where the engine's block size divides the
    trace's, a block is named by the trace's hash ids up to it and its place in its trace block,
    without building the prompt (the trace's prompts are functions of their hash ids)."""
    full = request.input_length // block_size
    if trace_block_size % block_size:
        builder = PromptBuilder(trace_block_size, block_size)
        return sequence_hashes(builder.local_hashes(request, builder.tokens(request)))
    per_id = trace_block_size // block_size
    keys: list = []
    chain = 0
    for hash_id in request.hash_ids:
        chain = hash((chain, hash_id))
        for part in range(per_id):
            if len(keys) == full:
                return keys
            keys.append((chain, part))
    return keys


def reuse_bounds(
    trace: Iterable[TraceRequest],
    trace_block_size: int,
    block_size: int,
    capacity_blocks: int,
    cache_replies: bool = False,
) -> ReuseBounds:
    """Both bounds of ``trace`` (arrival order) for a fleet holding ``capacity_blocks`` blocks in all;
    with ``cache_replies``, each continued turn's reply joins the caches with its turn, as
    ``kvmesh replay --cache-replies`` caches it on its worker (:mod:`kvmesh.replay.replies`)."""
    trace = list(trace)
    replies = reply_contexts(trace) if cache_replies else {}
    infinite, lru = _Cache(None), _Cache(capacity_blocks)
    prompt_tokens = kept_infinite = kept_lru = 0
    for position, request in enumerate(trace):
        hashes = block_keys(request, trace_block_size, block_size)
        usable = (request.input_length - 1) // block_size  # one token is always computed
        prompt_tokens += request.input_length
        kept_infinite += min(infinite.cached_prefix(hashes), usable) * block_size
        kept_lru += min(lru.cached_prefix(hashes), usable) * block_size
        reply = replies.get(position)
        if reply is not None:  # the context through the reply, as the next turn's prompt names it
            through = TraceRequest(0.0, len(reply) * trace_block_size, 1, reply)
            hashes = block_keys(through, trace_block_size, block_size)
        infinite.use(hashes)
        lru.use(hashes)
    if not prompt_tokens:
        return ReuseBounds(0.0, 0.0)
    return ReuseBounds(kept_infinite / prompt_tokens, kept_lru / prompt_tokens)
