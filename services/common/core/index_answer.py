"""What a prefix index answers for one query, per worker and tier (sans-I/O).

The indexer service computes it for the routers' queries and sends it over gRPC; ``kvmesh replay``
computes it from its own :class:`PrefixIndex` with the same function, so the router's cache view
(:mod:`kvmesh.router.cache_view`) reads the same answer in both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.core.tier_credits import offloaded_blocks
from kvmesh.common.wire.kv_events import POOLED_TIER
from kvmesh.common.wire.worker_key import IndexKey, TierKey, WorkerKey


class IndexAnswer(NamedTuple):
    """Per worker: matched prefix blocks in its device cache and its tree size; with a MoE query,
    (aligned matched blocks, queried experts hosted); past the device match, the blocks it can import
    from its KV pool, and those it holds offloaded in host memory and, past those, on disk. ``held``:
    where ``matched`` counts blocks still being computed (the replay's oracle), those each worker has
    computed (what a prefix pull can bring); None: ``matched`` counts only those."""

    matched: dict[WorkerKey, int]
    tree_sizes: dict[WorkerKey, int]
    moe: dict[WorkerKey, tuple[int, int]] = {}
    pooled: dict[WorkerKey, int] = {}
    host: dict[WorkerKey, int] = {}
    disk: dict[WorkerKey, int] = {}
    held: dict[WorkerKey, int] | None = None


EMPTY_ANSWER = IndexAnswer({}, {})


def answer_query(
    index: PrefixIndex,
    sequence: Sequence[int],
    experts: Collection[tuple[int, int]] = (),
    pool_of: Callable[[], Mapping[int, str]] | None = None,
) -> IndexAnswer:
    """The answer to a query of ``sequence`` (sequence hashes). ``experts``: the (layer, expert)
    pairs of a MoE query; ``pool_of``: gives the KV pool each worker that reads one is attached to
    (asked only when the match holds a pool segment: most fleets have no pool)."""
    matched = index.find_matches_by_sequence(sequence)
    alignment = index.moe_alignment(sequence, matched, set(experts)) if experts else {}
    pooled = pooled_blocks(matched, pool_of) if pool_of is not None else {}
    host, disk = offloaded_blocks(matched)
    sizes = index.tree_sizes()
    extra = (pooled.keys() | host.keys() | disk.keys()) - sizes.keys()
    if extra:  # a worker that caches nothing on its device yet can still read the pool or its host tier
        sizes = {**dict.fromkeys(extra, 0), **sizes}
    return IndexAnswer(
        {key: blocks for key, blocks in matched.items() if not isinstance(key, TierKey)},
        {key: size for key, size in sizes.items() if not isinstance(key, TierKey)},
        alignment,
        pooled,
        host,
        disk,
    )


def pooled_blocks(matched: Mapping[IndexKey, int], pools: Callable[[], Mapping[int, str]]) -> dict[WorkerKey, int]:
    """Per worker that reads a KV pool: the query's blocks past its own match that a segment of that
    pool holds (the longest prefix any of the pool's writers wrote)."""
    segments = {
        key.worker_id: blocks
        for key, blocks in matched.items()
        if isinstance(key, TierKey) and key.tier == POOLED_TIER and blocks
    }
    if not segments:  # the usual case: no pool, nothing more to do
        return {}
    pool_of = pools()
    best: dict[str, int] = {}
    for writer, blocks in segments.items():
        pool = pool_of.get(writer)
        if pool is not None and blocks > best.get(pool, 0):
            best[pool] = blocks
    result = {}
    for worker, pool in pool_of.items():
        key = WorkerKey(worker, 0)  # a pool is read by a worker's first rank (the one its engine is on)
        if best.get(pool, 0) > matched.get(key, 0):
            result[key] = best[pool] - matched.get(key, 0)
    return result
