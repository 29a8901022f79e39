"""How every service names one engine instance: a :class:`WorkerKey`, (worker, data-parallel rank).

A worker process may run several data-parallel ranks, each an engine core with its own KV cache; the
prefix index, the router's load picture, its cost function and its fitted step times all key on the
pair. A storage tier (host memory, disk, a KV pool) is not a rank: it is a field of its own
(a stream's ``tier``, keyed in the prefix index by a :class:`TierKey`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any, NamedTuple

from kvmesh.common.wire.kv_events import DEVICE_TIER

# A worker's discovery record says how many data-parallel ranks it runs under this key (absent: one).
DATA_PARALLEL_KEY = "data_parallel_size"
# ... and the Kubernetes pod it runs in under this one (``kvmesh worker --pod-name``; absent: none).
POD_KEY = "pod"


class WorkerKey(NamedTuple):
    """One engine instance: ``worker_id``'s data-parallel rank ``dp_rank``.

    A tuple, so a key read off the wire as ``(worker_id, dp_rank)`` finds the same entry: equal
    pairs hash and compare alike whichever way they were built."""

    worker_id: int
    dp_rank: int = 0


class TierKey(NamedTuple):
    """An offloaded storage tier (host memory, disk) of one engine instance, or a worker's KV pool
    segment: what the prefix index keys such a stream's blocks by, beside the device cache's
    :class:`WorkerKey`."""

    worker_id: int
    dp_rank: int
    tier: str

    @property
    def engine(self) -> WorkerKey:
        """The engine instance whose tier it is."""
        return WorkerKey(self.worker_id, self.dp_rank)


IndexKey = WorkerKey | TierKey


def index_key(worker_id: int, dp_rank: int, tier: str) -> IndexKey:
    """The key of a stream of KV events: its engine instance's, or for another tier than the device
    that tier's of it."""
    return WorkerKey(worker_id, dp_rank) if tier == DEVICE_TIER else TierKey(worker_id, dp_rank, tier)


def ranks_of(extra: Mapping[str, Any]) -> range:
    """The data-parallel ranks a worker's discovery record (its ``extra``) advertises: 0..size-1."""
    return range(max(1, int(extra.get(DATA_PARALLEL_KEY) or 1)))


def keys_of(worker_id: int, extra: Mapping[str, Any]) -> tuple[WorkerKey, ...]:
    """Every engine instance of one worker, from its discovery record's ``extra``, in rank order."""
    return _engine_keys(worker_id, len(ranks_of(extra)))


@lru_cache(maxsize=1 << 16)
def _engine_keys(worker_id: int, ranks: int) -> tuple[WorkerKey, ...]:
    """Why kept: every routing decision lists its candidates' keys, and building a key costs about a
    microsecond (a named tuple's constructor is Python code): at 256 workers, two such lists were a
    decision's largest cost. Bounded, since workers come and go with new ids."""
    return tuple(WorkerKey(worker_id, rank) for rank in range(ranks))
