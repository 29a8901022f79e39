"""KV transfer between two mock engines over real sockets: TCP always, NIXL when installed."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.worker.engines.mock.mock_engine import EngineConfig, EngineRequestSpec, MockEngine, transferable_blocks
from kvmesh.worker.kv_transfer.kv_buffer import KvBuffer, KvLayout
from kvmesh.worker.kv_transfer.nixl_agent import NixlAgent, nixl_available
from kvmesh.worker.kv_transfer.transport import KvTransferClient, KvTransferServer, TransferError
from tests.support import wait_until_async

BLOCK = 16
BLOCKS = 64
BACKENDS = [
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            not nixl_available(),
            reason="needs the nixl extra (pip install torch==2.13.0 && pip install -e '.[dev,nixl]')",
        ),
    ),
]
PROMPT = list(range(1000, 1100))  # 100 tokens: 6 transferable blocks

pytestmark = pytest.mark.integration


def make_engine() -> tuple[MockEngine, KvBuffer]:
    kv = KvBuffer(BLOCKS, KvLayout().block_bytes(BLOCK))
    return MockEngine(EngineConfig(num_blocks=BLOCKS, block_size=BLOCK), kv), kv


def run_to_end(engine: MockEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).append(output.token_id)
    return tokens


def prefill(engine: MockEngine, request_id: str, prompt: list[int]) -> list[int]:
    """Prefill with max_tokens=1 and hold; returns the slots of the transferable blocks."""
    engine.add_request(EngineRequestSpec(request_id, prompt, 1, seed=7), hold_on_finish=True)
    run_to_end(engine)
    held = engine.held[request_id]
    return [block.slot for block in held.blocks[: transferable_blocks(len(prompt), BLOCK)]]


class Pair:
    """A prefill engine with its transfer server, a decode engine with its client."""

    def __init__(self, backend: str) -> None:
        self.prefill_engine, self.prefill_kv = make_engine()
        self.decode_engine, self.decode_kv = make_engine()
        nixl_p = NixlAgent(f"p-{id(self)}", self.prefill_kv) if backend == "nixl" else None
        nixl_d = NixlAgent(f"d-{id(self)}", self.decode_kv) if backend == "nixl" else None
        self.server = KvTransferServer(self.prefill_kv, self.prefill_engine.release_held, 5.0, nixl_p)
        self.client = KvTransferClient(self.decode_kv, nixl_d)

    async def __aenter__(self) -> Pair:
        await self.server.start("127.0.0.1")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()

    async def pull(self, room: int, request_id: str, prompt: list[int], timeout: float = 5.0):
        plan = self.decode_engine.add_remote_prefill(EngineRequestSpec(request_id, prompt, 8, seed=7))
        assert plan is not None
        result = await self.client.pull(
            "127.0.0.1", self.server.port, room, plan.first_block, plan.slots, plan.sequence_hashes, timeout
        )
        return plan, result


@pytest.mark.parametrize("backend", BACKENDS)
async def test_decode_receives_the_prefill_kv_and_answers_as_an_aggregated_worker(backend):
    async with Pair(backend) as pair:
        # the decode worker already caches the first 2 blocks: only the other 4 move
        pair.decode_engine.add_request(EngineRequestSpec("warm", PROMPT[:40], 1))
        run_to_end(pair.decode_engine)
        slots = prefill(pair.prefill_engine, "p", PROMPT)
        pair.server.ready(42, "p", slots)

        plan, result = await pair.pull(42, "d", PROMPT)

        assert (plan.first_block, plan.num_blocks) == (2, 4)
        assert result.backend == backend
        assert result.bytes == 4 * pair.decode_kv.block_bytes
        for slot, content in zip(plan.slots, plan.sequence_hashes, strict=True):
            assert pair.decode_kv.holds(slot, content)
        # the prefill worker released what it held once the decode worker said it had the blocks
        await wait_until_async(lambda: not pair.prefill_engine.held, timeout=5, what="the prefill to release its KV")
        assert pair.prefill_engine.blocks.num_active == 0

        pair.decode_engine.finish_transfer("d", True)
        step = pair.decode_engine.step()
        assert step.prefill_tokens == len(PROMPT) - 6 * BLOCK  # only the tail is computed locally
        decoded = [o.token_id for o in step.outputs] + run_to_end(pair.decode_engine)["d"]

        aggregated, _ = make_engine()
        aggregated.add_request(EngineRequestSpec("a", PROMPT, 8, seed=7))
        assert decoded == run_to_end(aggregated)["a"]
        # the received blocks are now cached on the decode worker (and announced in KV events)
        assert pair.decode_engine.cached_prefix_tokens(PROMPT) == 6 * BLOCK


async def test_a_pull_that_arrives_before_the_prefill_waits_for_it():
    async with Pair("tcp") as pair:
        pulling = asyncio.create_task(pair.pull(7, "d", PROMPT))
        await wait_until_async(lambda: pair.server.pulls_waiting(7) == 1, what="the pull waits at the rendezvous")
        assert not pulling.done()
        pair.server.ready(7, "p", prefill(pair.prefill_engine, "p", PROMPT))
        plan, result = await asyncio.wait_for(pulling, 5)
        assert result.bytes == plan.num_blocks * pair.decode_kv.block_bytes


async def test_a_failed_prefill_is_reported_and_not_retried():
    async with Pair("tcp") as pair:
        pair.server.fail(9, "the prefill did not finish")
        with pytest.raises(TransferError) as caught:
            await pair.pull(9, "d", PROMPT)
        assert not caught.value.retryable
        assert "did not finish" in str(caught.value)


async def test_a_prefill_worker_that_is_gone_fails_the_pull_and_the_decode_can_prefill_locally():
    async with Pair("tcp") as pair:
        port = pair.server.port
    plan = pair.decode_engine.add_remote_prefill(EngineRequestSpec("d", PROMPT, 4, seed=7))
    with pytest.raises(TransferError):
        await pair.client.pull("127.0.0.1", port, 1, plan.first_block, plan.slots, plan.sequence_hashes, 2.0)
    pair.decode_engine.finish_transfer("d", False)  # falls back to an ordinary local prefill
    assert len(run_to_end(pair.decode_engine)["d"]) == 4
    assert pair.decode_engine.blocks.num_active == 0


async def test_corrupt_bytes_are_detected():
    async with Pair("tcp") as pair:
        slots = prefill(pair.prefill_engine, "p", PROMPT)
        pair.prefill_kv.fill(slots[3], 12345)  # not what block 3 holds
        pair.server.ready(5, "p", slots)
        with pytest.raises(TransferError, match="1 of 6"):
            await pair.pull(5, "d", PROMPT)
        assert pair.prefill_engine.held  # kept: the decode side did not confirm


async def test_held_blocks_are_released_when_nobody_comes():
    engine, kv = make_engine()
    server = KvTransferServer(kv, engine.release_held, 0.05, None)
    await server.start("127.0.0.1")
    try:
        server.ready(3, "p", prefill(engine, "p", PROMPT))
        assert engine.blocks.num_active > 0
        await wait_until_async(lambda: not engine.held, timeout=5, what="the hold to time out")
        assert engine.blocks.num_active == 0
    finally:
        await server.stop()
