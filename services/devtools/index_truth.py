"""Does an indexer replica hold exactly what the workers hold? Each worker's real cache (its own
dump) against the replica's view, compared by block count and digest per worker.

Also a command, ``python -m kvmesh.devtools.index_truth --nats-url URL --wait S``, that waits until
every indexer replica holds what the workers hold and prints, as JSON, why each one does not.
:func:`settle_in_fresh_process` runs it from the calling thread's network namespace: a thread that
joined a test host's namespace cannot use gRPC itself, because gRPC's own threads, which make its
connections, stay in the namespace where they were born (decision 69).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence

import grpc

from kvmesh.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.process import connect_nats
from kvmesh.common.wire.hashing import block_set_digest

__all__ = [
    "Settled",
    "as_truth",
    "converged",
    "difference",
    "settle",
    "settle_in_fresh_process",
    "truth",
    "view",
]


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


async def _held_by_workers(workers: DiscoveryWatcher) -> dict[int, tuple[int, int]]:
    """What a converged replica holds (:func:`as_truth`'s shape): the workers' caches with a block or more."""
    return {k: v for k, v in (await truth(workers)).items() if v[0]}


async def converged(workers: DiscoveryWatcher, address: str) -> bool:
    """Whether the replica at ``address`` holds exactly the workers' blocks (False while unreachable)."""
    try:
        holdings = await _held_by_workers(workers)
        return as_truth(await view(address)) == holdings
    except grpc.aio.AioRpcError:
        return False


async def difference(workers: DiscoveryWatcher, address: str) -> str:
    """Why the replica at ``address`` has not converged, in a line: how far it applied the stream,
    and each worker whose (blocks, digest) differs, as the replica holds it and as the worker does."""
    try:
        holdings = await _held_by_workers(workers)
        status = await view(address)
    except grpc.aio.AioRpcError as exc:
        return f"unreachable ({exc.code().name})"
    return _difference_line(status, holdings)


def _difference_line(status: indexer_pb2.IndexerStatus, holdings: dict[int, tuple[int, int]]) -> str:
    held = as_truth(status)
    differing = {
        w: (held.get(w), holdings.get(w)) for w in held.keys() | holdings.keys() if held.get(w) != holdings.get(w)
    }
    return (
        f"applied {status.applied_sequence} of {status.stream_last_sequence}, gaps {status.gaps}, "
        f"recoveries {status.recoveries}; differing workers (replica, worker): {differing or 'none'}"
    )


class Settled(dict[str, str]):
    """Each replica's address and why it has not converged ("" where it has); ``at`` is the
    ``time.monotonic()`` when the last one converged (the system's monotonic clock, comparable
    between processes on one machine), None if some replica never did."""

    at: float | None = None

    def ok(self) -> bool:
        return bool(self) and not any(self.values())


async def settle(
    nats_url: str, wait: float, *, namespace: str = "default", indexers: Sequence[str] = (), restored: bool = False
) -> Settled:
    """Poll until every replica in ``indexers`` (all those discovered, if none are named) holds what
    the workers hold, and with ``restored`` also restored from a snapshot, or ``wait`` seconds pass."""
    deadline = time.monotonic() + wait
    nc = await connect_nats(nats_url, name="index-truth", first_connect_timeout=max(wait, 1.0))
    workers = DiscoveryWatcher(nc.jetstream(), namespace, "worker")
    replicas = DiscoveryWatcher(nc.jetstream(), namespace, "indexer")
    try:
        await workers.start()
        await replicas.start()
        while True:
            addresses = list(indexers) or [r.address for r in replicas.instances()]
            try:  # the workers' caches once a round, every replica compared with the same
                holdings = await _held_by_workers(workers)
                result = Settled({a: await _why_not(holdings, a, restored) for a in addresses})
            except grpc.aio.AioRpcError as exc:
                result = Settled(
                    {a: f"a worker is unreachable ({exc.code().name}: {exc.details()})" for a in addresses}
                )
            if result.ok():
                result.at = time.monotonic()
                return result
            if time.monotonic() >= deadline:
                return result if addresses else Settled({"": "no indexer replica is registered"})
            await asyncio.sleep(0.1)
    finally:
        await replicas.stop()
        await workers.stop()
        await nc.close()


async def _why_not(holdings: dict[int, tuple[int, int]], address: str, restored: bool) -> str:
    """Why the replica at ``address`` does not hold ``holdings`` (or, with ``restored``, restored
    nothing from a snapshot), from one status query; empty where it does."""
    try:
        status = await view(address)
    except grpc.aio.AioRpcError as exc:
        return f"unreachable ({exc.code().name}: {exc.details()})"
    if restored and not status.snapshot_sequence:
        return "not restored from a snapshot"
    return "" if as_truth(status) == holdings else _difference_line(status, holdings)


async def settle_in_fresh_process(
    nats_url: str, wait: float, *, namespace: str = "default", indexers: Sequence[str] = (), restored: bool = False
) -> Settled:
    """:func:`settle` in a new Python process, born in the calling thread's network namespace."""
    argv = [sys.executable, "-m", "kvmesh.devtools.index_truth", "--nats-url", nats_url, "--wait", str(wait)]
    argv += ["--namespace", namespace, *(a for address in indexers for a in ("--indexer", address))]
    argv += ["--restored"] if restored else []
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    try:  # the last line: a service's log may come before it
        printed = json.loads(out.decode().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"index_truth exited {process.returncode}: {(out + err).decode()[-2000:]}") from None
    result = Settled(printed["replicas"])
    result.at = printed["at"]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh.devtools.index_truth",
        description="Wait until every indexer replica holds exactly what the workers hold; print as JSON "
        "why each replica has not (empty where it has). Exit 0 when all have, 1 when not.",
    )
    parser.add_argument("--nats-url", required=True, help="NATS server URL, or several comma-separated")
    parser.add_argument("--namespace", default="default", help="mesh namespace (default: default)")
    parser.add_argument("--wait", type=float, default=10.0, help="seconds to wait for convergence (default: 10)")
    parser.add_argument(
        "--indexer", action="append", default=[], help="a replica's address to check (repeatable; default: all)"
    )
    parser.add_argument("--restored", action="store_true", help="also require a restore from a snapshot")
    args = parser.parse_args(argv)
    result = asyncio.run(
        settle(args.nats_url, args.wait, namespace=args.namespace, indexers=args.indexer, restored=args.restored)
    )
    print(json.dumps({"replicas": result, "at": result.at}))
    return 0 if result.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
