"""A small typed Python client for the router's gRPC API (``kvmesh.v1.Router``).

    async with await RouterApi.discover("nats://127.0.0.1:4222") as api:
        loads = await api.potential_loads(token_ids)
        target = min(loads, key=lambda w: w.potential_prefill_tokens)
        answer = await api.complete(token_ids, max_tokens=16, worker_id=target.worker_id)

``best_worker`` and ``potential_loads`` ask without routing anything (like Dynamo's KvPushRouter);
``generate`` / ``complete`` serve a request on the one request path (the router plans it and hands
it on; the answer streams from the worker, :mod:`kvmesh.common.calling.request_path`), optionally forced to
one worker. Errors arrive as :class:`RouterApiError` with the gRPC status code.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc

from kvmesh.common.calling.request_path import RequestPath
from kvmesh.common.calling.router_client import RouterClient
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from kvmesh.common.rpc.grpc_server import channel_to
from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.process import connect_nats
from kvmesh.common.runtime.run_file import default_namespace, resolve_nats_url
from kvmesh.common.wire.finish_reasons import finish_name


class RouterApiError(StatusError):
    """The router answered with a gRPC status other than OK."""

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


@dataclass(frozen=True)
class WorkerChoice:
    worker_id: int
    dp_rank: int
    overlap_blocks: int


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: int
    dp_rank: int
    overlap_blocks: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_prefill_tokens: int
    active_decode_blocks: int


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    finish_reason: str | None
    worker_id: int


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    finish_reason: str
    worker_id: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class RouterApi:
    """One router replica's API. Use as an async context manager (closes the channel)."""

    def __init__(self, address: str, model: str = "") -> None:
        self.address = address
        self.model = model
        self._channel = channel_to(address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._routers = RouterClient(fixed_address=address)
        self._path = RequestPath(self._routers)

    @classmethod
    async def discover(
        cls, nats_url: str | None = None, namespace: str | None = None, model: str = "", timeout: float = 10.0
    ) -> RouterApi:
        """Connect to a router replica found in discovery. Without ``nats_url``: ``KVMESH_NATS_URL``,
        else the running ``kvmesh up`` of the namespace (its run file), else the default URL."""
        namespace = namespace or default_namespace()
        nats_url, _source = resolve_nats_url(nats_url, namespace)
        nc = await connect_nats(nats_url, name="kvmesh-client")
        try:
            watcher = DiscoveryWatcher(nc.jetstream(), namespace, "router")
            await watcher.start()
            try:
                await watcher.wait_for(bool, timeout)
            except TimeoutError as exc:
                raise RouterApiError(grpc.StatusCode.UNAVAILABLE, "no router replica is registered") from exc
            address = sorted(r.address for r in watcher.instances())[0]
            await watcher.stop()
        finally:
            await nc.close()
        return cls(address, model)

    async def __aenter__(self) -> RouterApi:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._path.close()
        await self._routers.close()
        await self._channel.close()

    def _query(self, token_ids: Sequence[int], expected_output_tokens: int | None) -> router_pb2.RoutingQuery:
        query = router_pb2.RoutingQuery(model=self.model, token_ids=token_ids)
        if expected_output_tokens is not None:
            query.expected_output_tokens = expected_output_tokens
        return query

    async def best_worker(self, token_ids: Sequence[int], expected_output_tokens: int | None = None) -> WorkerChoice:
        try:
            answer = await self._stub.BestWorker(self._query(token_ids, expected_output_tokens))
        except grpc.aio.AioRpcError as exc:
            raise RouterApiError(exc.code(), exc.details() or "") from exc
        return WorkerChoice(answer.worker_id, answer.dp_rank, answer.overlap_blocks)

    async def potential_loads(
        self, token_ids: Sequence[int], expected_output_tokens: int | None = None
    ) -> list[WorkerLoad]:
        try:
            answer = await self._stub.PotentialLoads(self._query(token_ids, expected_output_tokens))
        except grpc.aio.AioRpcError as exc:
            raise RouterApiError(exc.code(), exc.details() or "") from exc
        return [
            WorkerLoad(
                w.worker_id,
                w.dp_rank,
                w.overlap_blocks,
                w.potential_prefill_tokens,
                w.potential_decode_blocks,
                w.active_prefill_tokens,
                w.active_decode_blocks,
            )
            for w in answer.loads
        ]

    async def generate(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        worker_id: int | None = None,
        seed: int | None = None,
        request_id: str = "",
        priority: str = "",
        session: str = "",
    ) -> AsyncIterator[Chunk]:
        """Stream the answer; ``worker_id`` forces the worker (no KV choice, no migration);
        ``priority``: the router queue's class while every worker is busy (high, normal, low);
        ``session``: the session it belongs to (the router prefers the worker of its last turn)."""
        request = self._request(token_ids, max_tokens, worker_id, seed, request_id, priority, session)
        try:
            async with contextlib.aclosing(self._path.generate(request)) as outputs:
                async for output in outputs:
                    yield Chunk(tuple(output.token_ids), finish_name(output.finish_reason), output.worker_id)
        except grpc.aio.AioRpcError as exc:
            raise RouterApiError(exc.code(), exc.details() or "") from exc

    def _request(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        worker_id: int | None,
        seed: int | None,
        request_id: str,
        priority: str = "",
        session: str = "",
    ) -> common_pb2.PreprocessedRequest:
        request = common_pb2.PreprocessedRequest(
            request_id=request_id or uuid.uuid4().hex, model=self.model, token_ids=token_ids
        )
        request.stop.max_tokens = max_tokens
        if worker_id is not None:
            request.routing.worker_id = worker_id
        if seed is not None:
            request.sampling.seed = seed
        request.routing.priority = priority
        request.routing.session_id = session
        return request

    async def complete(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        worker_id: int | None = None,
        seed: int | None = None,
        priority: str = "",
        session: str = "",
    ) -> Completion:
        request = self._request(token_ids, max_tokens, worker_id, seed, "", priority, session)
        tokens: list[int] = []
        last = None
        try:
            async for output in self._path.generate(request):
                tokens.extend(output.token_ids)
                last = output
        except grpc.aio.AioRpcError as exc:
            raise RouterApiError(exc.code(), exc.details() or "") from exc
        if last is None:
            raise RouterApiError(grpc.StatusCode.INTERNAL, "the router sent no output")
        return Completion(
            tuple(tokens),
            finish_name(last.finish_reason, "stop"),
            last.worker_id,
            last.usage.prompt_tokens,
            last.usage.completion_tokens,
            last.usage.cached_prompt_tokens,
        )
