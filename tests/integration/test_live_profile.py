"""`kvmesh profile --worker-address`: a running worker measured over gRPC (here the mock engine in
real time, so the measurements can be held against its timing model)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.common.core.timing import TimingModel
from kvmesh.profiler.live import LiveProfiler
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import discovered, running, service_config, wait_until_async

pytestmark = pytest.mark.integration


async def test_a_live_worker_profile_follows_the_engine(nats_url: str):
    config = service_config(WorkerConfig, ["--nats-url", nats_url, "--namespace", "profiling"])
    async with running(worker_server.serve, config):
        records: list = []

        async def registered() -> bool:
            records[:] = await asyncio.to_thread(discovered, nats_url, "worker", "profiling")
            return bool(records)

        await wait_until_async(registered, timeout=20, what="the worker to register")
        profiler = LiveProfiler(records[0].address, vocab_size=256, max_prompt_tokens=8192)
        # lengths whose modelled TTFTs lie 29 ms and 120 ms apart: on a loaded two-core machine a
        # median of three can carry ~20 ms of scheduling delay, enough to swap 256 and 1,024 tokens
        profile = await profiler.measure(prefill_tokens=(256, 2048, 8192), concurrency=(1, 8), context_tokens=(512,))
    ttfts = [p.ttft_ms for p in profile.prefill]
    assert ttfts == sorted(ttfts) and len(ttfts) == 3
    model = TimingModel()
    for point in profile.prefill:
        # real time adds gRPC and scheduling overhead to the engine's own step time
        expected = model.prefill_ms(point.uncached_tokens)
        assert expected * 0.9 <= point.ttft_ms <= expected + 40
    assert {(p.concurrency, p.context_tokens) for p in profile.decode} == {(1, 512), (8, 512)}
    assert all(p.itl_ms >= 5.0 for p in profile.decode)  # the model's decode floor is 5.7 ms
