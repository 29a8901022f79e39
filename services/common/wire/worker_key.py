"""How every service names one engine instance: ``(worker_id, dp_rank)``.

A worker process may run several data-parallel ranks, each with its own KV cache; the prefix index,
the router's load picture and its cost function all key on the pair.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WorkerKey = tuple[int, int]

# A worker's discovery record says how many data-parallel ranks it runs under this key (absent: one).
DATA_PARALLEL_KEY = "data_parallel_size"


def ranks_of(extra: Mapping[str, Any]) -> range:
    """The data-parallel ranks a worker's discovery record (its ``extra``) advertises: 0..size-1."""
    return range(max(1, int(extra.get(DATA_PARALLEL_KEY) or 1)))
