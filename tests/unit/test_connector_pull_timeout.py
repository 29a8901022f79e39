"""A vLLM decode request whose KV pull brings nothing in time is aborted in the engine and prefilled
locally (or refused under --enforce-disagg), instead of waiting for ever; a pull that brings its
first token in time is left alone. The engine here is a stand-in that queues what it is told to:
what is tested is the handoff's decision, not vLLM."""

from __future__ import annotations

import msgpack
import pytest

from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.wire.disagg import DecodeOrder
from kvmesh.worker.engine import EngineRequestSpec, TokenOutput, TokenQueue
from kvmesh.worker.kv_transfer.connector_handoff import ConnectorHandoff

PARAMS = {"remote_engine_id": "e1", "remote_block_ids": [[1, 2, 3]]}


class StandInEngine:
    """Records submits and aborts; a remote-prefill request answers only when ``pulls_arrive``."""

    connector_backend = "nixl"
    kv_bytes_per_block = 1024

    def __init__(self, pulls_arrive: bool) -> None:
        self.pulls_arrive = pulls_arrive
        self.submitted: list[tuple[str, bool]] = []
        self.aborted: list[str] = []

    def submit(self, spec: EngineRequestSpec, kv_transfer_params: dict | None = None) -> TokenQueue:
        remote = kv_transfer_params is not None
        self.submitted.append((spec.request_id, remote))
        queue = TokenQueue()
        if self.pulls_arrive or not remote:
            queue.put_nowait(TokenOutput(spec.request_id, 7, None, cached_tokens=0))
        return queue

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def order(allow_local: bool) -> DecodeOrder:
    return DecodeOrder(1, "127.0.0.1", 1, 9, allow_local, msgpack.packb(PARAMS), cached_tokens=32)


SPEC = EngineRequestSpec("r1", [1, 2, 3], 4)


async def test_a_pull_that_arrives_is_left_alone():
    engine = StandInEngine(pulls_arrive=True)
    queue, source = await ConnectorHandoff(1, engine, pull_timeout_s=5).receive(SPEC, order(True))  # type: ignore[arg-type]
    assert source.source == "remote" and source.cached_tokens == 32 and source.blocks == 3
    assert engine.submitted == [("r1", True)] and engine.aborted == []
    assert (await queue.get()).token_id == 7


async def test_a_pull_that_brings_nothing_in_time_prefills_locally():
    engine = StandInEngine(pulls_arrive=False)
    queue, source = await ConnectorHandoff(1, engine, pull_timeout_s=0.05).receive(SPEC, order(True))  # type: ignore[arg-type]
    assert source.source == "local" and source.reason == "transfer_failed"
    assert engine.submitted == [("r1", True), ("r1", False)] and engine.aborted == ["r1"]
    assert (await queue.get()).token_id == 7


async def test_without_local_prefill_a_pull_that_brings_nothing_is_refused():
    engine = StandInEngine(pulls_arrive=False)
    with pytest.raises(StatusError, match="brought nothing"):
        await ConnectorHandoff(1, engine, pull_timeout_s=0.05).receive(SPEC, order(False))  # type: ignore[arg-type]
    assert engine.aborted == ["r1"] and engine.submitted == [("r1", True)]
