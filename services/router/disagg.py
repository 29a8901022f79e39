"""Prefill/decode disaggregation in the router: whether a request prefills remotely, where, and the
prefill request that runs beside (bootstrap) or before (sync) its decode.

Active only while a prefill-role worker for the request's model is registered. Per request:

1. the decode worker is chosen KV-aware as for an aggregated request; if it lacks fewer than
   ``--disagg-min-uncached-tokens`` of the prompt, it prefills locally (a transfer would cost more
   than it saves);
2. otherwise a prefill worker with capacity is chosen KV-aware among the prefill pool (none with
   capacity: local prefill), and the decode worker is chosen again on load alone (overlap weight 0),
   since its cache no longer decides how much prefill it does.

``--enforce-disagg`` turns every fallback into an error. See docs/decisions/0009.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import structlog

from kvmesh.common.disagg import DECODE, PREFILL, PREFILLED, DisaggParams, DisaggParamsError
from kvmesh.common.discovery import InstanceRecord
from kvmesh.common.grpc_errors import is_transport_failure
from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.router.policy import RoutingPolicy, WorkerKey

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where one request prefills and decodes (sans-I/O; worker keys, not records).

    ``prefill`` is None for a local prefill on ``decode``, with the ``reason``; ``overlap`` is the
    cached prefix in blocks on the worker that prefills."""

    decode: WorkerKey
    prefill: WorkerKey | None
    overlap: int
    reason: str = ""


class NoCapacity(Exception):
    """Every prefill worker is at capacity (only raised when local prefill is not allowed)."""


def place_prefill(
    policy: RoutingPolicy,
    decode_workers: Sequence[WorkerKey],
    prefill_workers: Sequence[WorkerKey],
    block_hashes: Sequence[int],
    prompt_tokens: int,
    overlaps: Mapping[WorkerKey, int],
    tree_sizes: Mapping[WorkerKey, int],
    *,
    min_uncached_tokens: int,
    prefill_queue_limit_tokens: int,
    enforce: bool = False,
    overlap_score_weight: float | None = None,
    temperature: float | None = None,
    expected_output_tokens: int = 0,
    busy: Callable[[WorkerKey], bool] = lambda _key: False,
) -> Placement:
    """The per-request decision of the module docstring. The router service and ``kvmesh replay``
    both call it, so the replay measures what the service does."""
    args = (block_hashes, prompt_tokens, overlaps, tree_sizes)
    local = policy.choose(decode_workers, *args, overlap_score_weight, temperature, expected_output_tokens)
    uncached = prompt_tokens - local.overlap_blocks * policy.block_size
    if not enforce and uncached < min_uncached_tokens:
        return Placement(local.worker, None, local.overlap_blocks, "below_threshold")
    with_capacity = [
        key for key in prefill_workers if not busy(key) and policy.active.load(key)[0] < prefill_queue_limit_tokens
    ]
    if not with_capacity:
        if enforce:
            raise NoCapacity(f"all {len(prefill_workers)} prefill workers are at capacity")
        return Placement(local.worker, None, local.overlap_blocks, "no_prefill_capacity")
    prefill = policy.choose(with_capacity, *args, overlap_score_weight, temperature, 0)
    decode = policy.choose(decode_workers, *args, 0.0, temperature, expected_output_tokens)
    return Placement(decode.worker, prefill.worker, prefill.overlap_blocks)


@dataclass
class RemotePrefill:
    prefill: InstanceRecord
    prefill_overlap: int
    decode: InstanceRecord
    block_hashes: list[int]


@dataclass
class LocalPrefill:
    decode: InstanceRecord
    overlap: int
    block_hashes: list[int]
    reason: str


@dataclass
class PrefillResult:
    """What the prefill worker answered: its cached prompt tokens and where its KV waits."""

    cached_tokens: int
    params: DisaggParams


def prefill_request(request: common_pb2.PreprocessedRequest, room: int) -> common_pb2.PreprocessedRequest:
    """The prefill half: a copy with ``max_tokens = 1`` that holds its KV for ``room``."""
    prefill = common_pb2.PreprocessedRequest()
    prefill.CopyFrom(request)
    prefill.request_id = f"{request.request_id}:prefill"
    prefill.stop.max_tokens = 1
    prefill.ClearField("expected_output_tokens")
    prefill.disaggregated_params = DisaggParams(PREFILL, room=room).encode()
    return prefill


def decode_request(request: common_pb2.PreprocessedRequest, params: DisaggParams) -> common_pb2.PreprocessedRequest:
    """The decode half: the original request (its own ``max_tokens``) with the KV's whereabouts."""
    decode = common_pb2.PreprocessedRequest()
    decode.CopyFrom(request)
    decode.disaggregated_params = params.encode()
    return decode


def bootstrap_params(prefill: InstanceRecord, room: int, allow_local: bool) -> DisaggParams:
    """Where the decode worker meets the prefill worker, known before the prefill runs."""
    return DisaggParams(
        DECODE,
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
            async for output in self._stub.Generate(self.request):
                if output.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    continue
                params = DisaggParams.decode(output.disaggregated_params)
                if params.kind != PREFILLED:
                    raise DisaggParamsError(f"the prefill worker answered {params.kind!r}")
                return PrefillResult(output.usage.cached_prompt_tokens, params)
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
