"""Does an indexer replica hold exactly what the workers hold? Each worker's real cache (its own
dump) against the replica's view, compared by block count and digest per worker."""

from __future__ import annotations

import grpc

from kvmesh.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire.hashing import block_set_digest

__all__ = ["as_truth", "converged", "difference", "truth", "view"]


async def truth(workers: DiscoveryWatcher) -> dict[int, tuple[int, int]]:
    """Each worker's real cache (dp rank 0): (block count, digest) from its own dump."""
    result = {}
    for record in workers.instances():
        async with grpc.aio.insecure_channel(record.address) as channel:
            dump = await worker_pb2_grpc.WorkerStub(channel).DumpKvState(worker_pb2.DumpKvStateRequest())
        result[record.instance_id] = (len(dump.blocks), block_set_digest(b.sequence_hash for b in dump.blocks))
    return result


async def view(address: str) -> indexer_pb2.IndexerStatus:
    async with grpc.aio.insecure_channel(address) as channel:
        return await indexer_pb2_grpc.IndexerStub(channel).GetStatus(
            indexer_pb2.IndexerStatusRequest(include_digests=True), timeout=5
        )


def as_truth(status: indexer_pb2.IndexerStatus) -> dict[int, tuple[int, int]]:
    """Each worker's rank 0 device cache as the replica holds it (offloaded tiers and pool segments
    are streams of their own, compared apart)."""
    return {
        w.worker_id: (w.blocks, w.blocks_digest)
        for w in status.workers
        if w.blocks and w.dp_rank == 0 and w.tier in ("", "device")
    }


async def converged(workers: DiscoveryWatcher, address: str) -> bool:
    """Whether the replica at ``address`` holds exactly the workers' blocks (False while unreachable)."""
    try:
        expected = {k: v for k, v in (await truth(workers)).items() if v[0]}
        return as_truth(await view(address)) == expected
    except grpc.aio.AioRpcError:
        return False


async def difference(workers: DiscoveryWatcher, address: str) -> str:
    """Why the replica at ``address`` has not converged, in a line: how far it applied the stream,
    and each worker whose (blocks, digest) differs, as the replica holds it and as the worker does."""
    try:
        expected = {k: v for k, v in (await truth(workers)).items() if v[0]}
        status = await view(address)
    except grpc.aio.AioRpcError as exc:
        return f"unreachable ({exc.code().name})"
    held = as_truth(status)
    differing = {
        w: (held.get(w), expected.get(w)) for w in held.keys() | expected.keys() if held.get(w) != expected.get(w)
    }
    return (
        f"applied {status.applied_sequence} of {status.stream_last_sequence}, gaps {status.gaps}, "
        f"recoveries {status.recoveries}; differing workers (replica, worker): {differing or 'none'}"
    )
