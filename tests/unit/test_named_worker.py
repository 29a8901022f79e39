"""A request that names its worker (sans-I/O: a fixed set of registered workers): it goes there, also
when the router avoids that worker for a broken stream (the client chose it), and is refused as
naming no registered worker only where that is so."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.router.routing import RoutingError
from tests.unit.test_disagg_planning import MODEL, router


def named(worker_id: int) -> common_pb2.PreprocessedRequest:
    request = common_pb2.PreprocessedRequest(request_id="r", model=MODEL, token_ids=list(range(40)))
    request.routing.worker_id = worker_id
    return request


@pytest.mark.parametrize("mode", ["kv", "direct", "round-robin"])
async def test_a_named_worker_avoided_for_a_broken_stream_still_takes_the_request(mode: str):
    mesh = router({1: "aggregated", 2: "aggregated"}, router_mode=mode, kv_events=False)
    mesh.avoid(1)
    choice = await mesh.choose(named(1), commit=False)
    assert choice.worker.instance_id == 1
    # the router's own choices still leave it
    if mode != "direct":
        anonymous = common_pb2.PreprocessedRequest(request_id="a", model=MODEL, token_ids=list(range(40)))
        chosen = [(await mesh.choose(anonymous, commit=False)).worker.instance_id for _ in range(4)]
        assert chosen == [2, 2, 2, 2]


@pytest.mark.parametrize("worker_id", [9, 3])
async def test_a_worker_not_registered_or_not_taking_whole_requests_is_refused_as_not_found(worker_id: int):
    # 9 is registered nowhere; 3 is a prefill worker, failed lately or not
    mesh = router({1: "aggregated", 3: "prefill"}, kv_events=False)
    mesh.avoid(3)
    with pytest.raises(RoutingError) as refused:
        await mesh.choose(named(worker_id), commit=False)
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    assert f"worker {worker_id} is not registered for this model" in str(refused.value)
