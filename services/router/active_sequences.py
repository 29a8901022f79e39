"""Predicted load of every worker from the requests the router has sent it (sans-I/O).

For each worker (and data-parallel rank) the router tracks its in-flight requests:

- *prefill tokens*: prompt tokens not served from cache, for requests whose first token has not
  arrived yet (prefill queued or running there);
- *decode blocks*: KV blocks held by active requests, where a prefix shared by several requests
  counts once (blocks are identified by sequence hash) and each request's partial last block counts
  on its own.

The three updates mirror a request's life: :meth:`add` on routing, :meth:`mark_prefill_completed`
on its first token and :meth:`free` on completion or cancellation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

WorkerKey = tuple[int, int]


@dataclass
class _Request:
    worker: WorkerKey
    block_hashes: tuple[int, ...]
    has_partial_block: bool
    prefill_tokens: int


@dataclass
class _WorkerLoad:
    prefill_tokens: int = 0
    partial_blocks: int = 0
    block_refs: dict[int, int] = field(default_factory=dict)

    @property
    def decode_blocks(self) -> int:
        return len(self.block_refs) + self.partial_blocks


@dataclass(frozen=True)
class PotentialLoad:
    """A worker's load if the request under consideration were sent to it."""

    worker: WorkerKey
    prefill_tokens: int
    decode_blocks: int


class ActiveSequences:
    """In-flight requests per worker. Guarantees: loads return to zero once every request is freed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._requests: dict[str, _Request] = {}
        self._loads: dict[WorkerKey, _WorkerLoad] = {}

    def add(
        self,
        request_id: str,
        worker: WorkerKey,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlap_blocks: int,
    ) -> None:
        """Record a request routed to ``worker`` (``block_hashes``: its full blocks' sequence hashes)."""
        if request_id in self._requests:
            self.free(request_id)
        prefill = max(0, prompt_tokens - overlap_blocks * self.block_size)
        request = _Request(worker, tuple(block_hashes), prompt_tokens % self.block_size != 0, prefill)
        self._requests[request_id] = request
        load = self._loads.setdefault(worker, _WorkerLoad())
        load.prefill_tokens += prefill
        load.partial_blocks += request.has_partial_block
        for h in request.block_hashes:
            load.block_refs[h] = load.block_refs.get(h, 0) + 1

    def mark_prefill_completed(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or request.prefill_tokens == 0:
            return
        self._loads[request.worker].prefill_tokens -= request.prefill_tokens
        request.prefill_tokens = 0

    def free(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        load = self._loads[request.worker]
        load.prefill_tokens -= request.prefill_tokens
        load.partial_blocks -= request.has_partial_block
        for h in request.block_hashes:
            count = load.block_refs[h] - 1
            if count:
                load.block_refs[h] = count
            else:
                del load.block_refs[h]

    def remove_worker(self, worker_id: int) -> None:
        """Forget a departed worker and every request that was on it."""
        for request_id in [r for r, req in self._requests.items() if req.worker[0] == worker_id]:
            del self._requests[request_id]
        for key in [k for k in self._loads if k[0] == worker_id]:
            del self._loads[key]

    def load(self, worker: WorkerKey) -> tuple[int, int]:
        """(prefill tokens, decode blocks) currently predicted for ``worker``."""
        load = self._loads.get(worker)
        return (load.prefill_tokens, load.decode_blocks) if load else (0, 0)

    def potential_loads(
        self,
        workers: Sequence[WorkerKey],
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlaps: dict[WorkerKey, int],
    ) -> list[PotentialLoad]:
        """Each worker's (prefill tokens, decode blocks) if this request were added to it."""
        partial = 1 if prompt_tokens % self.block_size else 0
        result = []
        for worker in workers:
            load = self._loads.get(worker) or _WorkerLoad()
            new_blocks = sum(1 for h in block_hashes if h not in load.block_refs)
            prefill = max(0, prompt_tokens - overlaps.get(worker, 0) * self.block_size)
            result.append(
                PotentialLoad(worker, load.prefill_tokens + prefill, load.decode_blocks + new_blocks + partial)
            )
        return result

    def __len__(self) -> int:
        return len(self._requests)
