"""What the workers' caches hold, asked over ``kvmesh.v1.Worker``, and what each worker's departure
would lose (docs/decisions/0051). Whoever stops a worker on a shrink asks this first: ``kvmesh up``'s
supervisor stops the cheapest departure itself, the planner's Kubernetes connector marks each pod with
its cost so that the ReplicaSet does, and a worker that hands its blocks on skips what a survivor holds.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

import grpc

from kvmesh.common.proto.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_server import channel_to
from kvmesh.common.runtime.discovery import InstanceRecord


async def cached_hashes(record: InstanceRecord) -> set[int]:
    """The sequence hashes a worker's cache holds (its rank 0; empty when it cannot say)."""
    try:
        async with channel_to(record.address) as channel:
            dump = await worker_pb2_grpc.WorkerStub(channel).DumpKvState(worker_pb2.DumpKvStateRequest(), timeout=10)
    except grpc.aio.AioRpcError:
        return set()
    return {b.sequence_hash for b in dump.blocks}


async def hot_list(record: InstanceRecord, max_blocks: int) -> set[int] | None:
    """The sequence hashes of a worker's ``max_blocks`` hottest cached blocks (None: it cannot say)."""
    request = worker_pb2.OfferBlocksRequest(max_blocks=max_blocks, list_only=True)
    try:
        async with channel_to(record.address) as channel:
            offer = await worker_pb2_grpc.WorkerStub(channel).OfferBlocks(request, timeout=10)
    except grpc.aio.AioRpcError:
        return None
    return {b.sequence_hash for b in offer.blocks}


def sole_holdings(own: Mapping[int, Collection[int]], held: Mapping[int, Collection[int]]) -> dict[int, int]:
    """For each worker of ``own``, how many of its blocks (sequence hashes) no other worker of
    ``held`` (every worker's cached blocks) holds: what its departure loses."""
    holders = Counter(h for hashes in held.values() for h in hashes)
    return {
        worker: sum(1 for h in blocks if holders[h] - (h in held.get(worker, ())) == 0)
        for worker, blocks in own.items()
    }


async def departure_costs(
    candidates: Sequence[InstanceRecord], everyone: Sequence[InstanceRecord], hot_blocks: int
) -> dict[int, int]:
    """For each candidate worker (by instance id) that answers: how many of its ``hot_blocks``
    hottest cached blocks no other worker of ``everyone`` holds. A candidate that cannot say is
    left out; a worker of ``everyone`` that cannot say counts as holding nothing."""
    hot = await asyncio.gather(*(hot_list(record, hot_blocks) for record in candidates))
    held = await asyncio.gather(*(cached_hashes(record) for record in everyone))
    own = {record.instance_id: blocks for record, blocks in zip(candidates, hot, strict=True) if blocks is not None}
    return sole_holdings(own, {record.instance_id: blocks for record, blocks in zip(everyone, held, strict=True)})
