"""The prefill half of a disaggregated request, as the router runs it: the two requests it sends
(the prefill half and the decode half), where they meet, and the prefill as a task of its own.

Where a request prefills is decided by :func:`kvmesh.router.prefill_placement.place_prefill`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_errors import is_transport_failure
from kvmesh.common.rpc.grpc_streams import messages
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire import disagg
from kvmesh.common.wire.disagg import DecodeOrder, DisaggParamsError, KvReady, PrefillOrder
from kvmesh.common.wire.requests import with_disaggregated_params

log = structlog.get_logger(__name__)


@dataclass
class RemotePrefill:
    """The request prefills on ``prefill`` (its rank ``prefill_rank``) and decodes on ``decode``
    (its rank ``decode_rank``)."""

    prefill: InstanceRecord
    prefill_overlap: int
    decode: InstanceRecord
    block_hashes: list[int]
    predicted_prefill_ms: float | None = None  # on the prefill worker, to its first token
    prefill_rank: int = 0
    decode_rank: int = 0


@dataclass
class LocalPrefill:
    """Prefill workers exist, but this request prefills on its decode worker, for ``reason``."""

    decode: InstanceRecord
    overlap: int
    block_hashes: list[int]
    reason: str
    decode_rank: int = 0


@dataclass
class PrefillResult:
    """What the prefill worker answered: its cached prompt tokens and where its KV waits."""

    cached_tokens: int
    ready: KvReady


def prefill_request(request: common_pb2.PreprocessedRequest, room: int) -> common_pb2.PreprocessedRequest:
    """The prefill half: a copy with ``max_tokens = 1`` that holds its KV for ``room``."""
    prefill = common_pb2.PreprocessedRequest()
    prefill.CopyFrom(request)
    prefill.request_id = f"{request.request_id}:prefill"
    prefill.stop.max_tokens = 1
    prefill.ClearField("expected_output_tokens")
    prefill.disaggregated_params = disagg.encode(PrefillOrder(room))
    return prefill


def decode_request(request: common_pb2.PreprocessedRequest, order: DecodeOrder) -> common_pb2.PreprocessedRequest:
    """The decode half: the original request (its own ``max_tokens``) with the KV's whereabouts."""
    return with_disaggregated_params(request, disagg.encode(order))


def bootstrap_order(prefill: InstanceRecord, room: int, allow_local: bool) -> DecodeOrder:
    """Where the decode worker meets the prefill worker, known before the prefill runs."""
    return DecodeOrder(
        room=room,
        host=str(prefill.extra.get("kv_transfer_host", prefill.address.rsplit(":", 1)[0])),
        port=int(prefill.extra.get("kv_transfer_port", 0)),
        worker_id=prefill.instance_id,
        allow_local=allow_local,
    )


class PrefillJob:
    """One prefill request on a prefill worker, run as a task. Its result is None if it failed."""

    def __init__(
        self,
        worker_id: int,
        stub: worker_pb2_grpc.WorkerStub,
        request: common_pb2.PreprocessedRequest,
        on_done: Callable[[], None],
    ) -> None:
        self.worker_id = worker_id
        self.request = request
        self.error: str | None = None
        self._stub = stub
        self._on_done = on_done
        self.transport_failed = False
        self.task: asyncio.Task[PrefillResult | None] = asyncio.create_task(self._run(), name="prefill")

    async def _run(self) -> PrefillResult | None:
        try:
            # a job cancelled mid-read (its request ended first) cancels the call and frees the read
            async with contextlib.aclosing(messages(self._stub.Generate(self.request))) as outputs:
                async for output in outputs:
                    if output.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                        continue
                    ready = disagg.decode_as(output.disaggregated_params, KvReady)
                    return PrefillResult(output.usage.cached_prompt_tokens, ready)
            self.error = "the prefill worker ended without an answer"
        except grpc.aio.AioRpcError as exc:
            self.transport_failed = is_transport_failure(exc)
            self.error = f"{exc.code().name}: {exc.details()}"
        except DisaggParamsError as exc:
            self.error = str(exc)
        finally:
            self._on_done()
        log.warning("prefill failed", request_id=self.request.request_id, error=self.error)
        return None

    async def result(self, timeout: float | None = None) -> PrefillResult | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except TimeoutError:
            return None

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
