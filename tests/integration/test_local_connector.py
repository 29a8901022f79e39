"""The planner's local connector over real NATS against the `kvmesh up` supervisor's pools: an
aggregated mesh and a disaggregated one (prefill and decode pools) are resized as asked, and a
request the supervisor cannot carry out reaches the planner as a ConnectorError, changing nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.wire import names
from kvmesh.planner.connectors import ConnectorError, LocalSupervisor
from kvmesh.planner.decision import PoolSizes
from kvmesh.worker_pool import WorkerPool, WorkerPools

pytestmark = pytest.mark.integration
NAMESPACE = "pools"


class WorkerProcess:
    """Stands in for a worker process: the pools only start, terminate and poll it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.running = False
        self.terminated = False
        self.pid = None

    def start(self) -> None:
        self.running = True

    def terminate(self) -> None:
        self.running, self.terminated = False, True

    def exited(self) -> int | None:
        return None if self.running else 0


def pool(role: str, services: list, started: int, low: int = 1, high: int = 4) -> WorkerPool:
    make: Callable[[int], WorkerProcess] = lambda index: WorkerProcess(f"{role}-{index}")  # noqa: E731
    workers = [make(i) for i in range(started)]
    for worker in workers:
        worker.start()
    services += workers
    return WorkerPool(services, workers, make, low, high, role)


async def supervise(nc: NatsClient, pools: WorkerPools) -> None:
    async def on_request(message) -> None:
        await message.respond(pools.answer(message.data))

    await nc.subscribe(names.planner_scale_subject(NAMESPACE), cb=on_request)
    await nc.flush()


async def test_the_planner_resizes_the_prefill_and_decode_pools_apart(nc):
    services: list = []
    prefill, decode = pool("prefill", services, 1), pool("decode", services, 1)
    await supervise(nc, WorkerPools({"prefill": prefill, "decode": decode}))
    connector = LocalSupervisor(nc, NAMESPACE)

    assert await connector.current(PoolSizes()) == PoolSizes(prefill=1, decode=1)
    assert await connector.scale(PoolSizes(prefill=2, decode=3)) == PoolSizes(prefill=2, decode=3)
    assert [w.name for w in prefill.workers] == ["prefill-0", "prefill-1"]
    assert all(w.running for w in services)

    youngest = decode.workers[-1]
    assert await connector.scale(PoolSizes(prefill=2, decode=2)) == PoolSizes(prefill=2, decode=2)
    assert youngest.terminated and youngest not in services  # no longer restarted by the supervisor
    # the pools keep to their bounds whatever the planner asks
    assert await connector.scale(PoolSizes(prefill=0, decode=9)) == PoolSizes(prefill=1, decode=4)


async def test_a_request_for_a_pool_the_mesh_lacks_is_refused_and_changes_nothing(nc):
    services: list = []
    prefill, decode = pool("prefill", services, 1), pool("decode", services, 2)
    await supervise(nc, WorkerPools({"prefill": prefill, "decode": decode}))
    connector = LocalSupervisor(nc, NAMESPACE)

    with pytest.raises(ConnectorError, match="no aggregated pool"):
        await connector.scale(PoolSizes(aggregated=3, prefill=2, decode=3))
    assert (prefill.size, decode.size) == (1, 2)


async def test_an_aggregated_mesh_answers_as_before(nc):
    services: list = []
    aggregated = pool("aggregated", services, 2)
    await supervise(nc, WorkerPools({"aggregated": aggregated}))
    connector = LocalSupervisor(nc, NAMESPACE)

    assert await connector.scale(PoolSizes(aggregated=3)) == PoolSizes(aggregated=3)
    with pytest.raises(ConnectorError, match="no prefill pool"):
        await connector.scale(PoolSizes(prefill=1, decode=1))
    assert aggregated.size == 3


async def test_without_a_supervisor_the_planner_is_told_what_to_start(nc):
    with pytest.raises(ConnectorError, match="kvmesh up --planner"):
        await LocalSupervisor(nc, "nobody-here", timeout=1.0).current(PoolSizes())


@pytest.mark.parametrize(
    "request_body",
    [b"[1, 2]", b'{"prefill": -1}', b'{"decode": "3"}', b'{"prefill": true}', b'{"gpu": 2}', b"{not json"],
)
def test_a_malformed_scale_request_is_answered_with_an_error_and_changes_nothing(request_body):
    services: list = []
    prefill, decode = pool("prefill", services, 1), pool("decode", services, 1)
    pools = WorkerPools({"prefill": prefill, "decode": decode})
    answer = pools.answer(request_body)
    assert b"bad scale request" in answer
    assert pools.sizes() == {"aggregated": 0, "prefill": 1, "decode": 1}


def test_a_shrink_stops_the_named_cheapest_departures_first_then_the_youngest():
    services: list = []
    aggregated = pool("aggregated", services, 4)
    pools = WorkerPools({"aggregated": aggregated})
    first, second, third, fourth = aggregated.workers
    assert pools.shrinking(b'{"aggregated": 2}') == ["aggregated"] and pools.shrinking(b'{"aggregated": 5}') == []
    pools.answer(b'{"aggregated": 2}', {"aggregated": [second]})
    assert second.terminated and fourth.terminated  # the named one, then the youngest
    assert aggregated.workers == [first, third] and not (first.terminated or third.terminated)
