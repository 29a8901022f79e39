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
from kvmesh.router.routing import RouteInput, Router, RoutingError
from kvmesh.router.split_overhead import SplitOverhead

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
    """A router over these workers; its placement rules apart from the gain gate (``always``) unless
    ``disagg_split_when`` says otherwise."""
    config = RouterConfig(seed=1, **{"disagg_split_when": "always", **options})
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
        mesh.picture.free("queued")
        assert isinstance(await mesh.plan_prefill(request(2000)), RemotePrefill)


async def test_the_router_adopts_each_workers_advertised_timing_and_forgets_a_departed_one():
    from kvmesh.common.core.timing import TimingModel, as_constants, from_constants, scaled

    mesh = router({1: "aggregated", 2: "aggregated"})
    slow = as_constants(scaled(TimingModel(), 2.0))
    mesh.workers.get(2).extra["timing"] = slow
    prepared = mesh.prepare(RouteInput.of(request(64)))
    cost = mesh.chooser.policy(prepared.candidates[0]).cost_model
    assert cost.timing((2, 0)) == from_constants(slow)
    assert cost.timing((1, 0)) == TimingModel()  # nothing advertised: the prior
    mesh.worker_left(mesh.workers.get(2))
    assert cost.timing((2, 0)) == TimingModel()


def test_every_data_parallel_rank_is_costed_with_its_own_fitted_timing_and_forgotten_with_its_worker():
    from kvmesh.common.core.timing import TimingModel, as_constants, from_constants, scaled

    mesh = router({1: "aggregated", 2: "aggregated"})
    ranked = mesh.workers.get(2)
    slow, slower = as_constants(scaled(TimingModel(), 2.0)), as_constants(scaled(TimingModel(), 3.0))
    ranked.extra.update({"data_parallel_size": 3, "timing": slow, "timing_by_rank": {"1": slower}})
    prepared = mesh.prepare(RouteInput.of(request(64)))
    cost = mesh.chooser.policy(prepared.candidates[0]).cost_model
    # rank 1 advertises its own fit; ranks 0 and 2 the worker's
    assert [cost.timing((2, rank)) for rank in range(3)] == [
        from_constants(slow),
        from_constants(slower),
        from_constants(slow),
    ]
    mesh.worker_left(ranked)
    assert all(cost.timing((2, rank)) == TimingModel() for rank in range(3))


async def test_a_prefill_workers_advertised_timing_is_adopted_when_prefills_are_placed():
    from kvmesh.common.core.timing import TimingModel, as_constants, from_constants, scaled

    mesh = router({1: "decode", 3: "prefill"})
    slow = as_constants(scaled(TimingModel(), 3.0))
    mesh.workers.get(3).extra["timing"] = slow
    plan = await mesh.plan_prefill(request(2000))
    assert isinstance(plan, RemotePrefill)
    prepared = mesh.prepare(RouteInput.of(request(64)))
    assert mesh.chooser.policy(prepared.candidates[0]).cost_model.timing((3, 0)) == from_constants(slow)


async def test_a_split_is_made_only_where_it_is_predicted_to_pay():
    """Idle identical workers: a remote prefill takes as long as a local one, and the split's
    overhead comes on top — the request prefills locally. A decode worker busy decoding (its steps
    carry long decodes) makes a local prefill slower: then the split pays, unless the measured
    overhead eats the gain."""
    # no predict-on-route: the same prompt is planned again below, and would be predicted cached
    mesh = router({1: "decode", 3: "prefill"}, disagg_split_when="gain", router_predicted_ttl_secs=0)
    idle = await mesh.plan_prefill(request(2000))
    assert isinstance(idle, LocalPrefill) and idle.reason == "no_gain"
    decode = mesh.workers.get(1)
    for i in range(40):  # 40 long decodes on the decode worker: each prefill step there carries them
        mesh.track_add(f"decoding-{i}", decode, list(range(i * 1000, i * 1000 + 200)), 16, 0, 2000)
        mesh.picture.first_token(f"decoding-{i}")
    busy = await mesh.plan_prefill(request(2000))
    assert isinstance(busy, RemotePrefill) and busy.predicted_prefill_ms is not None
    # the splits measured so far each added 10 s: no gain left
    for i in range(5):
        mesh.picture.split_started(f"slow-{i}", 0.0, mesh.clock())
        mesh.split_overhead.observe(10_000.0, mesh.clock())
    assert isinstance(await mesh.plan_prefill(request(2000)), LocalPrefill)


async def test_a_split_counts_the_stall_a_local_prefill_puts_on_the_decode_workers_requests():
    """The decode worker decodes 8 requests that hold no blocks (so a local prefill's own first
    token is no later there) and the split's overhead outweighs the prefill worker's lead. By the
    first token alone the request stays local; counting the 8 requests that would each wait through
    its prefill steps, the split pays."""
    from kvmesh.router.prefill_placement import decode_stall_ms, predicted_ttft_ms

    def decoding_mesh(overhead_ms: float, decoding: int) -> Router:
        mesh = router(
            {1: "decode", 3: "prefill"},
            disagg_split_when="gain",
            router_predicted_ttl_secs=0,
            disagg_split_overhead_ms=overhead_ms,
        )
        for i in range(decoding):
            mesh.track_add(f"decoding-{i}", mesh.workers.get(1), [], 8, 0, 0)
            mesh.picture.first_token(f"decoding-{i}")
        return mesh

    probe = decoding_mesh(0.0, 8)
    policy = probe.chooser.policy(probe.workers.get(1))
    local = predicted_ttft_ms(policy, (1, 0), 2000)
    stall = decode_stall_ms(policy, (1, 0), 2000)
    remote = predicted_ttft_ms(policy, (3, 0), 2000)
    assert stall == pytest.approx(8 * remote)  # the same prefill, idle workers: 8 requests wait through it
    overhead = local - remote + stall / 2  # more than the first token gains, less than the stall
    assert isinstance(await decoding_mesh(overhead, 8).plan_prefill(request(2000)), RemotePrefill)
    idle = await decoding_mesh(overhead, 0).plan_prefill(request(2000))
    assert isinstance(idle, LocalPrefill) and idle.reason == "no_gain"


def test_the_split_overhead_is_measured_and_drifts_back_to_its_prior_without_samples():
    overhead = SplitOverhead(prior_ms=5.0, weight=0.5, half_life_s=10.0)
    assert overhead.estimate(0.0) == 5.0
    overhead.observe(405.0, now=0.0)  # the first sample is the mean
    assert overhead.estimate(0.0) == 405.0
    overhead.observe(205.0, now=0.0)
    assert overhead.estimate(0.0) == 305.0
    assert overhead.estimate(10.0) == pytest.approx(5.0 + 300.0 / 2)  # one half-life later
    assert overhead.estimate(1000.0) == pytest.approx(5.0)  # back at the prior: a split is tried again


def test_the_router_measures_a_splits_overhead_from_its_first_token():
    now = [100.0]
    mesh = Router(
        RouterConfig(seed=1),
        RegisteredWorkers([worker(1, "decode"), worker(3, "prefill")]),
        IndexerClient(None, ChannelPool(), 0.5, random.Random(1)),
        clock=lambda: now[0],
    )
    mesh.picture.split_started("split", 40.0, mesh.clock())
    now[0] += 0.25  # its first token came 250 ms after the decision, its prefill predicted at 40
    mesh.picture.first_token("split")
    assert mesh.split_overhead.samples == 1 and mesh.split_overhead.estimate(now[0]) == pytest.approx(210.0)
    mesh.picture.split_started("lost", 40.0, mesh.clock())
    mesh.picture.free("lost")  # ended before a first token (failed, cancelled): no sample
    mesh.picture.first_token("lost")
    assert mesh.split_overhead.samples == 1
