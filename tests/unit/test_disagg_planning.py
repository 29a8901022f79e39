"""The router's per-request disaggregation decision (sans-I/O: a fixed set of registered workers)."""

from __future__ import annotations

import random

import grpc
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.router.config import RouterConfig
from kvmesh.router.indexer_client import IndexerClient
from kvmesh.router.prefill_job import LocalPrefill, RemotePrefill
from kvmesh.router.routing import Router, RoutingError

MODEL = "kvmesh-tiny"


class RegisteredWorkers:
    """The workers discovery would list: a fixed set (the decision reads nothing else)."""

    def __init__(self, records: list[InstanceRecord]) -> None:
        self._records = {r.instance_id: r for r in records}

    def instances(self) -> list[InstanceRecord]:
        return list(self._records.values())

    def get(self, instance_id: int) -> InstanceRecord | None:
        return self._records.get(instance_id)


def worker(instance_id: int, role: str) -> InstanceRecord:
    return InstanceRecord(
        "worker",
        instance_id,
        f"127.0.0.1:{9000 + instance_id}",
        role=role,
        model=MODEL,
        block_size=16,
        capacity_blocks=4096,
        extra={"kv_transfer_host": "127.0.0.1", "kv_transfer_port": 7000 + instance_id},
    )


def router(roles: dict[int, str], **options) -> Router:
    config = RouterConfig(seed=1, **options)
    workers = RegisteredWorkers([worker(i, role) for i, role in roles.items()])
    return Router(config, workers, IndexerClient(None, ChannelPool(), 0.5, random.Random(1)))


def request(tokens: int) -> common_pb2.PreprocessedRequest:
    return common_pb2.PreprocessedRequest(request_id="r", model=MODEL, token_ids=list(range(tokens)))


async def test_no_prefill_worker_routes_as_aggregated_or_is_an_error_when_enforced():
    assert await router({1: "decode", 2: "decode"}).plan_prefill(request(2000)) is None
    with pytest.raises(RoutingError) as caught:
        await router({1: "decode"}, enforce_disagg=True).plan_prefill(request(2000))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and "--enforce-disagg" in str(caught.value)


async def test_long_uncached_prompt_prefills_on_the_prefill_worker():
    plan = await router({1: "decode", 2: "decode", 3: "prefill"}).plan_prefill(request(2000))
    assert isinstance(plan, RemotePrefill)
    assert plan.prefill.instance_id == 3 and plan.decode.role == "decode"
    assert len(plan.block_hashes) == 2000 // 16


async def test_short_uncached_part_prefills_locally_unless_the_threshold_is_zero():
    plan = await router({1: "decode", 3: "prefill"}).plan_prefill(request(300))
    assert isinstance(plan, LocalPrefill) and plan.reason == "below_threshold" and plan.decode.instance_id == 1
    remote = await router({1: "decode", 3: "prefill"}, disagg_min_uncached_tokens=0).plan_prefill(request(300))
    assert isinstance(remote, RemotePrefill)


async def test_prefill_pool_without_capacity_falls_back_or_refuses_when_enforced():
    for enforce in (False, True):
        # no predict-on-route: the same prompt is planned again below, and would be predicted cached
        mesh = router(
            {1: "decode", 3: "prefill"},
            prefill_queue_limit_tokens=1000,
            enforce_disagg=enforce,
            router_predicted_ttl_secs=0,
        )
        prefill = mesh.workers.get(3)
        mesh.track_add("queued", prefill, [], 4000, 0, 0)  # 4,000 prefill tokens already queued there
        if enforce:
            with pytest.raises(RoutingError) as caught:
                await mesh.plan_prefill(request(2000))
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            plan = await mesh.plan_prefill(request(2000))
            assert isinstance(plan, LocalPrefill) and plan.reason == "no_prefill_capacity"
        mesh.track_free("queued")
        assert isinstance(await mesh.plan_prefill(request(2000)), RemotePrefill)


async def test_the_router_adopts_each_workers_advertised_timing_and_forgets_a_departed_one():
    from kvmesh.common.core.timing import TimingModel, as_constants, from_constants, scaled

    mesh = router({1: "aggregated", 2: "aggregated"})
    slow = as_constants(scaled(TimingModel(), 2.0))
    mesh.workers.get(2).extra["timing"] = slow
    prepared = mesh.prepare(request(64))
    cost = prepared.policy.cost_model
    assert cost.timing((2, 0)) == from_constants(slow)
    assert cost.timing((1, 0)) == TimingModel()  # nothing advertised: the prior
    mesh.worker_left(mesh.workers.get(2))
    assert cost.timing((2, 0)) == TimingModel()


async def test_a_prefill_workers_advertised_timing_is_adopted_when_prefills_are_placed():
    from kvmesh.common.core.timing import TimingModel, as_constants, from_constants, scaled

    mesh = router({1: "decode", 3: "prefill"})
    slow = as_constants(scaled(TimingModel(), 3.0))
    mesh.workers.get(3).extra["timing"] = slow
    plan = await mesh.plan_prefill(request(2000))
    assert isinstance(plan, RemotePrefill)
    assert mesh.prepare(request(64)).policy.cost_model.timing((3, 0)) == from_constants(slow)
