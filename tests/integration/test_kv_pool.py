"""The host KV pool over real NATS, gRPC and shared memory: a block one worker computed is imported
by another instead of recomputed, the indexer reports it as pooled, and a stream whose worker is
killed resumes on a worker that imports the dead worker's blocks from the pool."""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from pathlib import Path

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.client import RouterApi
from kvmesh.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh.common.runtime.ports import pid_listening_on
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from tests.support import metric_samples, router_generate, wait_until_async, worker_mesh

pytestmark = pytest.mark.integration
NAMESPACE = "pool"
PROMPT = list(range(3000, 3000 + 16 * 40 + 5))  # 40 full blocks of 16


@pytest.fixture
def pool_dir():
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="kvmesh-pool-test-", dir=shm if shm.is_dir() else None))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.asynccontextmanager
async def pool_mesh(nc: NatsClient, nats_url: str, pool: Path, workers: int = 2):
    """An indexer, a router and worker processes sharing ``pool``; yields (router, indexer, processes, watcher)."""
    flags = ("--kv-pool", str(pool), "--speedup-ratio", "2", "--lease-ttl", "30")
    async with worker_mesh(nc, nats_url, NAMESPACE, flags, workers) as mesh:
        yield mesh.router, mesh.indexer, mesh.processes, mesh.workers


async def pooled_blocks(indexer: str, prompt: list[int]) -> dict[int, tuple[int, int]]:
    """(matched, pooled) blocks per worker for ``prompt``."""
    request = indexer_pb2.FindMatchesRequest(sequence_hashes=sequence_hashes(local_block_hashes(prompt, 16)))
    async with grpc.aio.insecure_channel(indexer) as channel:
        response = await indexer_pb2_grpc.IndexerStub(channel).FindMatches(request)
    return {w.worker_id: (w.matched_blocks, w.pooled_blocks) for w in response.workers}


def pool_counters(record) -> dict[str, float]:
    samples = metric_samples(record.extra["metrics"], "kvmesh_worker_kv_pool_blocks_total")
    return {labels["direction"]: value for labels, value in samples}


async def test_a_block_one_worker_computed_is_imported_by_another(nats_url: str, nc: NatsClient, pool_dir: Path):
    async with pool_mesh(nc, nats_url, pool_dir) as (router, indexer, _processes, workers):
        first, second = workers.instances()
        await router_generate(router, "a", PROMPT, 2, first.instance_id)
        # the indexer sees the blocks on `first` and, through the pool, within reach of `second`
        await wait_until_async(
            lambda: _equals(pooled_blocks(indexer, PROMPT), {first.instance_id: (40, 0), second.instance_id: (0, 40)}),
            timeout=10,
            what="the pooled blocks indexed",
        )
        outputs = await router_generate(router, "b", PROMPT, 2, second.instance_id)
        assert outputs[-1].usage.cached_prompt_tokens == 40 * 16  # imported, not recomputed
        assert pool_counters(second)["imported"] == 40
        assert pool_counters(first)["written"] >= 40


async def _equals(pending, expected) -> bool:
    return (await pending) == expected


async def test_a_stream_whose_worker_is_killed_resumes_from_the_pool(nats_url: str, nc: NatsClient, pool_dir: Path):
    async with pool_mesh(nc, nats_url, pool_dir) as (router, _indexer, processes, workers):
        by_pid = dict(zip([p.pid for p in processes], processes, strict=True))
        received, first_worker = 0, None
        async with RouterApi(router) as api:
            async for chunk in api.generate(PROMPT, max_tokens=200, request_id="long"):
                received += len(chunk.token_ids)
                if first_worker is None:
                    first_worker = chunk.worker_id
                    record = next(r for r in workers.instances() if r.instance_id == first_worker)
                    victim = next(p for pid, p in by_pid.items() if _listens(pid, record.address))
                    victim.send_signal(signal.SIGKILL)
                last = chunk
        assert received == 200 and last.worker_id != first_worker
        survivor = next(r for r in workers.instances() if r.instance_id == last.worker_id)
        assert pool_counters(survivor)["imported"] >= 40  # the prompt came from the dead worker's segment


def _listens(pid: int, address: str) -> bool:
    return pid_listening_on(int(address.rsplit(":", 1)[1])) == pid
