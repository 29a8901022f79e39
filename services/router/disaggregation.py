"""The router's side of a split request (prefill/decode disaggregation) on the one request path.

When the router splits a request it sends the prefill half to the prefill worker itself (a
:class:`~kvmesh.router.prefill_job.PrefillJob`) and hands the decode half on like any other
request; the answer streams from the decode worker to the frontend. The router holds each
prefill job until the frontend reports the request's end, and learns where the decode worker got
the prompt's KV from the frontend's first-token report (the decode worker's
:class:`~kvmesh.common.wire.disagg.KvSource`).

Two ways to meet, chosen by the prefill worker's engine, which advertises it (``kv_handoff`` in
discovery): the *bootstrap* path (the mock engine: the decode half carries the rendezvous at once
and pulls the KV when the prefill has run) and the *sync* path (an engine with its own KV
connector, vLLM: the router waits for the prefill's answer and passes its KV parameters on). A
mock worker started with ``--kv-handoff sync`` behaves as such an engine does.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.wire import disagg
from kvmesh.common.wire.disagg import DecodeOrder, DisaggParamsError, KvSource, default_kv_handoff
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.prefill_job import PrefillJob, RemotePrefill, bootstrap_order, decode_request, prefill_request
from kvmesh.router.routing import Router, RoutingError

log = structlog.get_logger(__name__)

# How long a finished prefill job is remembered for its request's reports when no end is reported
# (the frontend's stream to this replica broke): long past any first token.
FORGET_AFTER_S = 120.0


class Disaggregation:
    """The prefill jobs of the split requests this replica routed, by request id. Guarantees: each
    job is closed once (its request's end was reported, or :data:`FORGET_AFTER_S` after it ended);
    a prefill worker whose stream broke is avoided; every split request is counted once in
    ``kvmesh_router_prefills`` when its first token is reported."""

    def __init__(self, router: Router, channels: ChannelPool, metrics: RouterMetrics) -> None:
        self._router = router
        self._channels = channels
        self._metrics = metrics
        self._jobs: dict[str, PrefillJob] = {}

    async def start(
        self, request: common_pb2.PreprocessedRequest, plan: RemotePrefill
    ) -> common_pb2.PreprocessedRequest:
        """Send the prefill half of ``request`` to ``plan.prefill``; return the decode half to hand
        on. On the sync path this waits for the prefill's answer; if the prefill failed, the request
        goes to the decode worker whole (counted as a local prefill), or fails under
        ``--enforce-disagg``."""
        config = self._router.config
        room = disagg.new_room()
        prefill_half = prefill_request(request, room)
        record = plan.prefill
        router = self._router
        router.track_add(
            prefill_half.request_id,
            record,
            plan.block_hashes,
            len(request.token_ids),
            plan.prefill_overlap,
            0,
            plan.prefill_rank,
        )
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(record.address))
        job = PrefillJob(record.instance_id, stub, prefill_half, lambda: router.picture.free(prefill_half.request_id))
        job.task.add_done_callback(lambda _task: self._prefill_ended(request.request_id, job))
        self._jobs[request.request_id] = job
        allow_local = not config.enforce_disagg
        # the prefill worker says how its engine meets decode workers (a worker that does not say:
        # its engine's own way)
        kv_handoff = record.extra.get("kv_handoff") or default_kv_handoff(str(record.extra.get("engine", "mock")))
        if kv_handoff == "bootstrap":
            return decode_request(request, bootstrap_order(record, room, allow_local))
        result = await job.result()
        if result is None:
            self.end(request.request_id)
            if config.enforce_disagg:
                raise RoutingError(
                    grpc.StatusCode.UNAVAILABLE, f"prefill on worker {record.instance_id} failed: {job.error}"
                )
            self._metrics.prefills.labels("local", "prefill_failed").inc()
            return request
        return decode_request(request, DecodeOrder.from_ready(result.ready, allow_local))

    def first_token(self, request_id: str, kv_source: bytes) -> None:
        """The decode worker's first output came, saying where the prompt's KV came from."""
        job = self._jobs.get(request_id)
        if job is None:
            return  # not split here, or its sync prefill failed (already counted)
        try:
            source = disagg.decode_as(kv_source, KvSource)
        except DisaggParamsError:
            source = KvSource.local("transfer_failed")
        if source.source == "remote":
            self._metrics.prefills.labels("remote", "").inc()
            self._metrics.kv_transfer_bytes.labels(source.backend).inc(source.bytes)
            return
        reason = source.reason
        if job.task.done() and job.task.result() is None:
            reason = "prefill_failed"
        self._metrics.prefills.labels("local", reason).inc()

    def end(self, request_id: str) -> None:
        """The request ended: its prefill job is no longer needed (cancelled if still running)."""
        job = self._jobs.pop(request_id, None)
        if job is not None and not job.task.done():
            job.task.cancel()

    def _prefill_ended(self, request_id: str, job: PrefillJob) -> None:
        if job.transport_failed:
            self._router.avoid(job.worker_id)
        if self._jobs.get(request_id) is job:
            asyncio.get_running_loop().call_later(FORGET_AFTER_S, self._forget, request_id, job)

    def _forget(self, request_id: str, job: PrefillJob) -> None:
        if self._jobs.get(request_id) is job:
            del self._jobs[request_id]

    def close(self) -> None:
        for request_id in list(self._jobs):
            self.end(request_id)
