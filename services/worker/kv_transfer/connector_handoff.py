"""A worker's half of disaggregation when its engine moves KV with a connector of its own (vLLM's
NIXL connector): the worker only carries the engine's parameters between the two sides.

Prefill side: the held prefill's last output carries vLLM's ``kv_transfer_params`` (where the blocks
wait: engine id, block ids, side-channel host and port); they travel to the router in ``KvReady``.
Decode side: the parameters from the ``DecodeOrder`` go back into vLLM with ``do_remote_prefill``;
vLLM pulls the missing blocks over NIXL and computes the rest. The rendezvous is vLLM's, so the
router runs these pairs on the sync path (the decode request starts once the prefill has answered).
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import msgpack
import structlog

from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.wire.disagg import DecodeOrder, KvReady, KvSource, PrefillOrder
from kvmesh.worker.engine import EngineRequestSpec, TokenOutput, TokenQueue
from kvmesh.worker.engines.vllm.vllm_engine import VllmEngine

log = structlog.get_logger(__name__)


def held_blocks(params: dict[str, Any]) -> int:
    """Blocks a prefill's ``kv_transfer_params`` hold (vLLM lists them per KV cache group)."""
    groups = params.get("remote_block_ids") or []
    return len(groups[0]) if groups and isinstance(groups[0], list) else len(groups)


class ConnectorHandoff:
    """Guarantees: a decode request never pulls without parameters; with none (or unreadable ones)
    it prefills locally when the router allowed it and is refused otherwise. A pull that has not
    brought the first token within ``pull_timeout_s`` is aborted in the engine and the request
    prefills locally (or is refused under ``--enforce-disagg``): vLLM's NIXL connector now and then
    completes the handshake and never moves the KV (the prefill side lets the blocks go after its
    lease), and the request would otherwise wait for ever."""

    def __init__(self, worker_id: int, engine: VllmEngine, pull_timeout_s: float = 30.0) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.pull_timeout_s = pull_timeout_s
        self.transfers = 0

    @property
    def backend(self) -> str:
        return self.engine.connector_backend

    def transfers_in_flight(self) -> int:
        return 0  # vLLM's connector does not report its pulls to us

    def hand_off(self, spec: EngineRequestSpec, order: PrefillOrder, last: TokenOutput) -> KvReady:
        params = last.kv_transfer_params or {}
        return KvReady(
            room=order.room,
            host=str(params.get("remote_host", "")),
            port=int(params.get("remote_port", 0) or 0),
            worker_id=self.worker_id,
            blocks=held_blocks(params),
            backend=self.backend,
            engine_params=msgpack.packb(params),
            cached_tokens=last.cached_tokens,
        )

    def prefill_failed(self, order: PrefillOrder, reason: str) -> None:
        """Nothing to release: vLLM frees an aborted prefill's blocks itself."""

    async def receive(self, spec: EngineRequestSpec, order: DecodeOrder) -> tuple[TokenQueue, KvSource]:
        try:
            params = msgpack.unpackb(order.engine_params) if order.engine_params else None
        except Exception:  # garbage from the wire: treated as no parameters
            params = None
        if not isinstance(params, dict) or not params.get("remote_engine_id"):
            if not order.allow_local:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the decode order carries no vLLM KV parameters")
            return self.engine.submit(spec), KvSource.local("transfer_failed")
        params = {**params, "do_remote_prefill": True, "do_remote_decode": False}
        blocks = held_blocks(params)
        queue = self.engine.submit(spec, kv_transfer_params=params)
        self.transfers += 1
        log.info("KV pull handed to vLLM", blocks=blocks, prefill_worker=order.worker_id)
        started = time.monotonic()
        if not await queue.wait_for_item(self.pull_timeout_s):
            self.engine.abort(spec.request_id)
            log.warning("KV pull brought nothing in time", seconds=self.pull_timeout_s, prefill_worker=order.worker_id)
            if not order.allow_local:
                details = f"the KV pull from worker {order.worker_id} brought nothing in {self.pull_timeout_s} s"
                raise StatusError(grpc.StatusCode.UNAVAILABLE, details)
            return self.engine.submit(spec), KvSource.local("transfer_failed")
        size = blocks * self.engine.kv_bytes_per_block
        # the pull, vLLM noticing the blocks, and its first step: what a split costs on this side
        log.info("first token after the KV pull", seconds=round(time.monotonic() - started, 4), blocks=blocks)
        return queue, KvSource("remote", self.backend, size, blocks, cached_tokens=order.cached_tokens)
