"""Cached blocks by tier, and what each tier is worth to routing (sans-I/O; DESIGN §7's tiers).

A worker's offloaded copies are indexed as dp ranks of their own (``HOST_DP_RANK``,
``DISK_DP_RANK``), so a query matches each tier on its own; :func:`offloaded_blocks` turns those
matches into the blocks each tier adds past the device's, and :func:`credited_matches` credits them:
a device block counts 1, a block past it the better of its host tier's and its KV pool's credit,
then a disk block past both its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from kvmesh.common.wire.kv_events import DISK_DP_RANK, HOST_DP_RANK
from kvmesh.common.wire.worker_key import WorkerKey


def offloaded_blocks(matched: Mapping[WorkerKey, int]) -> tuple[dict[WorkerKey, int], dict[WorkerKey, int]]:
    """Per worker (dp rank 0): the query's blocks past its device match that its host tier holds,
    and past both, that its disk tier holds."""
    host: dict[WorkerKey, int] = {}
    disk: dict[WorkerKey, int] = {}
    for (worker, rank), blocks in matched.items():
        if rank == HOST_DP_RANK and blocks > matched.get((worker, 0), 0):
            host[(worker, 0)] = blocks - matched.get((worker, 0), 0)
    for (worker, rank), blocks in matched.items():
        if rank == DISK_DP_RANK:
            covered = matched.get((worker, 0), 0) + host.get((worker, 0), 0)
            if blocks > covered:
                disk[(worker, 0)] = blocks - covered
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
