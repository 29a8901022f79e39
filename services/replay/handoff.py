"""A shrink that hands its cache on, in the replay (``--shrink-handoff-blocks``, docs/decisions/0051).

When the planner shrinks a pool, the virtual connector removes the joined worker whose departure
costs least: the one holding the fewest cached blocks no other serving worker holds (a worker not
yet joined goes first, as before: it holds nothing). Before it stops, that worker sends its hottest
cached blocks (those running sequences hold, then the most recently released, each with its
prefix; at most ``--shrink-handoff-blocks``), skipping blocks a survivor already holds, to the
survivors over the KV transfer the workers have (``--kv-transfer-gbps``, ``--kv-bytes-per-token``):
each prefix family (the blocks under one root) to the survivor with the fewest requests in flight.
The blocks arrive when the bytes would have, are cached on the receivers as if computed there, and
reach the index through the ordinary KV events, so the router sends those sessions to their new
holders. The leaving worker costs worker-seconds until its last block is sent.

A join that starts warm (``--join-warmup-blocks``): a worker whose start-up is over first imports
the fleet's hottest prefixes where demand outruns their holders (the hot blocks of the serving
workers of its pool with at least their mean of requests in flight, the busiest first, taken from
each in turn), at most that many blocks and no more than arrive within ``--join-warmup-secs``; it
registers, and takes requests, once they have arrived. It costs worker-seconds while it imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.common.calling.worker_caches import sole_holdings
from kvmesh.worker.engines.mock.block_moves import Block, families
from kvmesh.worker.engines.mock.mock_engine import MockEngine


def departure_costs(serving: Sequence[int], engines: Sequence[MockEngine]) -> dict[int, int]:
    """For each serving worker, its cached blocks that no other serving worker holds: what its
    departure loses (counted once for all of them)."""
    cached = {worker: engines[worker].cached_hashes() for worker in serving}
    return sole_holdings(cached, cached)


@dataclass(frozen=True)
class Handoff:
    arrives_ms: float
    parts: dict[int, list[Block]]  # receiver -> its blocks, parent first


def plan_handoff(
    source: int,
    survivors: Sequence[int],
    engines: Sequence[MockEngine],
    requests_on: Callable[[int], int],
    limit: int,
    transfer_ms: Callable[[int], float],
    now_ms: float,
) -> Handoff | None:
    """What ``source`` sends before it leaves (None: nothing worth sending, or nobody to take it)."""
    if limit <= 0 or not survivors:
        return None
    held: set[int] = set()
    for survivor in survivors:
        held |= engines[survivor].cached_hashes()
    hot = engines[source].hot_blocks(limit)
    # a block whose parent a survivor holds can hang under it there; one a survivor holds is skipped
    to_send = families(hot, skip=held)
    if not to_send:
        return None
    load = {survivor: requests_on(survivor) for survivor in survivors}
    by_hash = {block[0]: block for block in hot}
    parts: dict[int, list[Block]] = {}
    # the largest families first, each to the survivor with the fewest requests (and blocks given)
    for family in sorted(to_send, key=len, reverse=True):
        receiver = min(survivors, key=lambda s: (load[s], len(parts.get(s, ())), s))
        parts.setdefault(receiver, []).extend(held_prefix(family[0], by_hash, held) + family)
        load[receiver] += 1
    return Handoff(now_ms + transfer_ms(sum(len(part) for part in parts.values())), parts)


def held_prefix(first: Block, by_hash: dict[int, Block], held: set[int]) -> list[Block]:
    """The ancestors of a family's first block that a survivor holds (and so were skipped), root
    first: the receiver may not be that survivor, and the family must hang under them there."""
    prefix = []
    node = by_hash.get(first[2]) if first[2] is not None else None
    while node is not None:
        if node[0] in held:
            prefix.append(node)
        node = by_hash.get(node[2]) if node[2] is not None else None
    return prefix[::-1]


@dataclass(frozen=True)
class Warmup:
    arrives_ms: float
    blocks: list[Block]  # parent first


def plan_warmup(
    serving: Sequence[int],
    engines: Sequence[MockEngine],
    requests_on: Callable[[int], int],
    limit: int,
    transfer_ms: Callable[[int], float],
    bound_ms: float,
    now_ms: float,
) -> Warmup | None:
    """What a started worker imports from ``serving`` before it serves (None: nothing to import, or
    no busy worker). ``transfer_ms``: how long moving so many blocks takes (linear in them).

    Guarantees: every block comes after its parent (each source lists its blocks so, and a block taken
    from one source was taken with its ancestors before it), none twice, at most ``limit`` blocks and
    no more than the transfer moves in ``bound_ms``."""
    if limit <= 0 or not serving:
        return None
    load = {worker: requests_on(worker) for worker in serving}
    mean = sum(load.values()) / len(load)
    busy = sorted((w for w in serving if load[w] and load[w] >= mean), key=lambda w: (-load[w], w))
    budget = min(limit, int(bound_ms / transfer_ms(1)))
    if not busy or budget <= 0:
        return None
    sources = [iter(engines[worker].hot_blocks(budget)) for worker in busy]
    chosen: dict[int, Block] = {}
    while sources and len(chosen) < budget:
        for source in list(sources):
            block = next((b for b in source if b[0] not in chosen), None)
            if block is None:
                sources.remove(source)
            elif len(chosen) < budget:
                chosen[block[0]] = block
    if not chosen:
        return None
    return Warmup(now_ms + transfer_ms(len(chosen)), list(chosen.values()))
