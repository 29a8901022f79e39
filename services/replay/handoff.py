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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.worker.engines.mock.mock_engine import MockEngine

Block = tuple[int, int, int | None]  # (sequence hash, local hash, parent sequence hash)


def unique_blocks(worker: int, serving: Sequence[int], engines: Sequence[MockEngine]) -> int:
    """Cached blocks of ``worker`` that no other serving worker holds: what its departure loses."""
    others: set[int] = set()
    for other in serving:
        if other != worker:
            others |= engines[other].cached_hashes()
    return len(engines[worker].cached_hashes() - others)


@dataclass(frozen=True)
class Handoff:
    source: int
    arrives_ms: float
    parts: dict[int, list[Block]]  # receiver -> its blocks, parent first

    @property
    def blocks(self) -> int:
        return sum(len(part) for part in self.parts.values())


def plan_handoff(
    source: int,
    survivors: Sequence[int],
    engines: Sequence[MockEngine],
    requests_on: Callable[[int], int],
    limit: int,
    block_bytes: int,
    transfer_gbps: float,
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
    families: dict[int, list[Block]] = {}
    root_of: dict[int, int] = {}
    for block in hot:
        sequence_hash, _local, parent = block
        root = root_of.get(parent, sequence_hash) if parent is not None else sequence_hash
        root_of[sequence_hash] = root
        if sequence_hash not in held:
            families.setdefault(root, []).append(block)
    if not families:
        return None
    load = {survivor: requests_on(survivor) for survivor in survivors}
    parts: dict[int, list[Block]] = {}
    # the largest families first, each to the survivor with the fewest requests (and blocks given)
    for family in sorted(families.values(), key=len, reverse=True):
        receiver = min(survivors, key=lambda s: (load[s], len(parts.get(s, ())), s))
        # the family's blocks a survivor holds were skipped: its own prefix must come along
        prefix = [b for b in hot if b[0] in held and _ancestor_of(b[0], family, hot)]
        parts.setdefault(receiver, []).extend(prefix + family)
        load[receiver] += 1
    sent = sum(len(part) for part in parts.values())
    transfer_ms = sent * block_bytes / (transfer_gbps * 1e6)
    return Handoff(source, now_ms + transfer_ms, parts)


def _ancestor_of(candidate: int, family: list[Block], hot: list[Block]) -> bool:
    """Whether ``candidate`` is on the parent chain of the family's first block (within ``hot``)."""
    parents = {sequence_hash: parent for sequence_hash, _local, parent in hot}
    node = family[0][2]
    while node is not None:
        if node == candidate:
            return True
        node = parents.get(node)
    return False
