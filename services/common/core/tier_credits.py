"""Cached blocks by tier, and what each tier is worth to routing (sans-I/O; DESIGN §7's tiers).

An engine instance's offloaded copies (host memory, disk) are indexed as streams of their own,
keyed by a :class:`~kvmesh.common.wire.worker_key.TierKey`, so a query matches each tier on its own;
:func:`offloaded_blocks` turns those matches into the blocks each tier adds past the device's, for
the same (worker, rank), and :func:`credited_matches` credits them: a device block counts 1, a block
past it the better of its host tier's and its KV pool's credit, then a disk block past both its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from kvmesh.common.wire.kv_events import DISK_TIER, HOST_TIER
from kvmesh.common.wire.worker_key import IndexKey, TierKey, WorkerKey


def offloaded_blocks(matched: Mapping[IndexKey, int]) -> tuple[dict[WorkerKey, int], dict[WorkerKey, int]]:
    """Per engine instance: the query's blocks past its device match that its host tier holds, and
    past both, that its disk tier holds."""
    host: dict[WorkerKey, int] = {}
    disk: dict[WorkerKey, int] = {}
    for key, blocks in matched.items():
        if isinstance(key, TierKey) and key.tier == HOST_TIER:
            device = matched.get(key.engine, 0)
            if blocks > device:
                host[key.engine] = blocks - device
    for key, blocks in matched.items():
        if isinstance(key, TierKey) and key.tier == DISK_TIER:
            covered = matched.get(key.engine, 0) + host.get(key.engine, 0)
            if blocks > covered:
                disk[key.engine] = blocks - covered
    return host, disk


class TierCredits(NamedTuple):
    """What a block of each tier counts as, against one in device memory."""

    pooled: float
    host: float
    disk: float


def credited_matches(
    matched: Mapping[WorkerKey, int],
    credits: TierCredits,
    *,
    pooled: Mapping[WorkerKey, int],
    host: Mapping[WorkerKey, int],
    disk: Mapping[WorkerKey, int],
) -> dict[WorkerKey, int]:
    """Each worker's match with the blocks past it credited by tier, rounded to whole blocks."""
    result = dict(matched)
    for worker in pooled.keys() | host.keys() | disk.keys():
        past = max(credits.host * host.get(worker, 0), credits.pooled * pooled.get(worker, 0))
        past += credits.disk * disk.get(worker, 0)
        result[worker] = result.get(worker, 0) + round(past)
    return result
