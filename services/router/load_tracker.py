"""The router's predicted load of every worker, through each request's life (sans-I/O).

One :class:`ActiveSequences` per block size (workers of one model share a block size; a mixed fleet
keeps separate pictures). A request is tracked from routing (:meth:`LoadTracker.add`) through its
first token (:meth:`~LoadTracker.first_token`) and output (:meth:`~LoadTracker.output`) to its end
(:meth:`~LoadTracker.free`). Requests other router replicas announced are tracked beside ours under
keys that cannot clash (``<router_id>/<request_id>``) and dropped together when that replica goes
silent. The clock comes in as a parameter, so ``kvmesh replay`` drives this very class in virtual
time.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.common.wire.worker_load import WorkerLoad
from kvmesh.router.active_sequences import ActiveSequences
from kvmesh.router.sync_messages import ADD, FREE, PREFILL_DONE, SyncMessage


def remote_key(router_id: str, request_id: str) -> str:
    """The key of another replica's request in this tracker."""
    return f"{router_id}/{request_id}"


class LoadTracker:
    """Guarantees: every request added is counted on exactly one worker until it is freed, expired,
    forgotten with its router or dropped with its worker; then the loads it added are gone."""

    def __init__(self, track_active_blocks: bool = True, track_output_blocks: bool = False) -> None:
        self.track_active_blocks = track_active_blocks
        self.track_output_blocks = track_output_blocks
        self._sequences: dict[int, ActiveSequences] = {}
        # every tracked request (ours and remote) -> the block size whose picture holds it
        self._block_size_of: dict[str, int] = {}
        self._remote_by_router: dict[str, set[str]] = {}

    def sequences(self, block_size: int) -> ActiveSequences:
        """The load picture of workers with this block size (created empty on first use)."""
        sequences = self._sequences.get(block_size)
        if sequences is None:
            sequences = self._sequences[block_size] = ActiveSequences(
                block_size, self.track_active_blocks, self.track_output_blocks
            )
        return sequences

    def __contains__(self, request_id: str) -> bool:
        """Whether a request with this id is in flight (this replica's or another's)."""
        return request_id in self._block_size_of

    def pictures(self) -> list[ActiveSequences]:
        return list(self._sequences.values())

    def worker_loads(self) -> list[WorkerLoad]:
        """Each worker's predicted load now (every picture's workers; ours and other replicas' requests)."""
        return [load for sequences in self._sequences.values() for load in sequences.worker_loads()]

    # ---- this replica's requests -----------------------------------------------------------
    def add(
        self,
        request_id: str,
        worker: WorkerKey,
        block_size: int,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlap_blocks: int,
        expected_output_tokens: int,
        now: float,
    ) -> None:
        """A request was routed to ``worker``: its uncached prompt queues there as prefill work and
        its blocks become active."""
        self.sequences(block_size).add(
            request_id, worker, block_hashes, prompt_tokens, overlap_blocks, expected_output_tokens, now
        )
        self._block_size_of[request_id] = block_size

    def first_token(self, request_id: str, now: float | None = None) -> None:
        """The request's first token arrived (at ``now``): its prefill is done."""
        block_size = self._block_size_of.get(request_id)
        if block_size is not None:
            self._sequences[block_size].mark_prefill_completed(request_id, now)

    def output(self, request_id: str, tokens: int) -> None:
        """``tokens`` more output tokens (they grow the request's blocks with output tracking)."""
        block_size = self._block_size_of.get(request_id)
        if block_size is not None:
            self._sequences[block_size].add_output(request_id, tokens)

    def free(self, request_id: str, now: float | None = None, output_tokens: int = 0) -> None:
        """The request ended (finished, failed or cancelled; at ``now``, None where no worker said so),
        having produced ``output_tokens`` (0: not said)."""
        block_size = self._block_size_of.pop(request_id, None)
        if block_size is not None:
            self._sequences[block_size].free(request_id, now, output_tokens)

    # ---- other replicas' requests ----------------------------------------------------------
    def apply_remote(self, message: SyncMessage, block_size: int | None, now: float) -> None:
        """Another replica's request event. ``block_size`` is that of the worker an ``add`` names,
        None when this replica does not know the worker (yet): nothing is predicted for it then."""
        key = remote_key(message.router_id, message.request_id)
        if message.kind == ADD:
            if block_size is None:
                return
            self.add(
                key,
                (message.worker_id, message.dp_rank),
                block_size,
                message.block_hashes,
                message.prompt_tokens,
                message.overlap_blocks,
                message.expected_output_tokens,
                now,
            )
            self._remote_by_router.setdefault(message.router_id, set()).add(key)
        elif message.kind == PREFILL_DONE:
            self.first_token(key, now)
        elif message.kind == FREE:
            self.free(key, now)
            self._remote_by_router.get(message.router_id, set()).discard(key)

    def forget_router(self, router_id: str) -> None:
        """A replica went silent: drop every request it had told us about."""
        for key in self._remote_by_router.pop(router_id, set()):
            self.free(key)

    # ---- housekeeping ----------------------------------------------------------------------
    def expire(self, now: float, max_age: float) -> list[str]:
        """Drop requests tracked longer than ``max_age`` (their free was lost); returns their keys."""
        expired = [key for sequences in self._sequences.values() for key in sequences.expire(now, max_age)]
        for key in expired:
            self._forget_key(key)
        return expired

    def remove_worker(self, worker_id: int) -> None:
        """A worker left: forget it and every request that was on it."""
        for sequences in self._sequences.values():
            for key in sequences.remove_worker(worker_id):
                self._forget_key(key)

    def _forget_key(self, key: str) -> None:
        """Drop the bookkeeping of a request its picture already let go of."""
        self._block_size_of.pop(key, None)
        router_id, _, rest = key.partition("/")
        if rest:
            self._remote_by_router.get(router_id, set()).discard(key)

    def __len__(self) -> int:
        return len(self._block_size_of)
