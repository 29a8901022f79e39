"""The router queue (kvmesh.router.request_queue): who waits, who goes next, who is refused.

A "fleet" here is a counter of free slots: a try takes one or raises AllWorkersBusy, as the router's
decision does when every worker is over its thresholds; freeing a slot tells the queue.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.common.wire.priority import parse_shares
from kvmesh.router.request_queue import (
    AllWorkersBusy,
    QueueConfig,
    QueueRefusal,
    RouterQueue,
)


class Fleet:
    def __init__(self, slots: int) -> None:
        self.free = slots
        self.admitted: list[str] = []

    def attempt(self, name: str):
        async def take() -> str:
            await asyncio.sleep(0)  # a decision awaits the indexer
            if self.free <= 0:
                raise AllWorkersBusy("all 1 workers are busy", uncached_tokens=int(name.split("-")[-1] or 0))
            self.free -= 1
            self.admitted.append(name)
            return name

        return take

    def release(self, queue: RouterQueue, slots: int = 1) -> None:
        self.free += slots
        queue.capacity_freed()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def config(**fields) -> QueueConfig:
    return QueueConfig(**{"size": 8, "timeout_s": 5.0, **fields})


async def test_requests_route_at_once_while_capacity_lasts_then_wait_and_go_in_arrival_order():
    fleet, queue = Fleet(2), RouterQueue(config())
    tasks = [asyncio.create_task(queue.route("m", "normal", fleet.attempt(f"r{i}-0"))) for i in range(5)]
    await settle()
    assert fleet.admitted == ["r0-0", "r1-0"] and queue.depth("m") == 3
    for _ in range(3):
        fleet.release(queue)
        await settle()
    assert await asyncio.gather(*tasks) == [f"r{i}-0" for i in range(5)]
    assert fleet.admitted == [f"r{i}-0" for i in range(5)] and queue.depth() == 0


async def test_a_newcomer_queues_behind_waiting_requests_even_if_a_slot_is_free_for_it():
    fleet, queue = Fleet(0), RouterQueue(config())
    first = asyncio.create_task(queue.route("m", "normal", fleet.attempt("first-0")))
    await settle()
    fleet.free = 1  # a slot frees without the queue being told yet
    late = asyncio.create_task(queue.route("m", "normal", fleet.attempt("late-0")))
    await settle()
    assert fleet.admitted == [] and queue.depth("m") == 2
    fleet.release(queue, 1)
    await settle()
    assert fleet.admitted == ["first-0", "late-0"]
    await asyncio.gather(first, late)


async def test_shortest_uncached_prefill_first_orders_a_class_by_the_tokens_its_best_worker_lacks():
    fleet, queue = Fleet(0), RouterQueue(config(policy="spf"))
    tasks = [asyncio.create_task(queue.route("m", "normal", fleet.attempt(f"r-{n}"))) for n in (900, 100, 500)]
    await settle()
    fleet.release(queue, 3)
    await settle()
    assert fleet.admitted == ["r-100", "r-500", "r-900"]
    await asyncio.gather(*tasks)


async def test_classes_share_turns_by_their_shares_and_the_low_class_is_never_starved():
    fleet, queue = Fleet(0), RouterQueue(config(size=64, shares=parse_shares("high=6,normal=3,low=1")))
    tasks = [
        asyncio.create_task(queue.route("m", priority, fleet.attempt(f"{priority}{i}-0")))
        for i in range(20)
        for priority in ("low", "normal", "high")
    ]
    await settle()
    for _ in range(20):  # one slot at a time: each turn is one admission
        fleet.release(queue)
        await settle()
    first20 = [name.rstrip("-0").rstrip("0123456789") for name in fleet.admitted[:20]]
    assert first20.count("high") == 12 and first20.count("normal") == 6 and first20.count("low") == 2
    fleet.release(queue, 40)
    await asyncio.gather(*tasks)
    assert len(fleet.admitted) == 60


async def test_a_full_class_is_refused_at_once_with_resource_exhausted_and_other_classes_still_queue():
    fleet, queue = Fleet(0), RouterQueue(config(size=2))
    waiting = [asyncio.create_task(queue.route("m", "low", fleet.attempt(f"low{i}-0"))) for i in range(2)]
    await settle()
    with pytest.raises(QueueRefusal) as refused:
        await queue.route("m", "low", fleet.attempt("low2-0"))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in str(refused.value)
    assert 1 <= refused.value.retry_after_secs <= 60
    high = asyncio.create_task(queue.route("m", "high", fleet.attempt("high0-0")))
    await settle()
    assert queue.depth("m", "high") == 1
    fleet.release(queue, 3)
    await asyncio.gather(*waiting, high)


async def test_a_request_whose_deadline_passes_is_refused_unavailable_and_leaves_the_others_their_turn():
    fleet, queue = Fleet(0), RouterQueue(config(timeout_s=0.2))
    expiring = asyncio.create_task(queue.route("m", "normal", fleet.attempt("old-0")))
    await asyncio.sleep(0.1)
    later = asyncio.create_task(queue.route("m", "normal", fleet.attempt("new-0")))
    with pytest.raises(QueueRefusal) as refused:
        await expiring
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "deadline" in str(refused.value)
    fleet.release(queue)
    assert await later == "new-0"


async def test_a_cancelled_request_that_held_the_turn_passes_it_on():
    fleet, queue = Fleet(0), RouterQueue(config())
    gate = asyncio.Event()

    async def slow_try() -> str:
        await gate.wait()  # its decision is in flight when its client leaves
        raise AllWorkersBusy("busy")

    leaving = asyncio.create_task(queue.route("m", "normal", slow_try))
    await settle()
    staying = asyncio.create_task(queue.route("m", "normal", fleet.attempt("stay-0")))
    await settle()
    fleet.free = 1
    queue.capacity_freed()  # the turn goes to the first: its try waits at the gate
    await settle()
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert await asyncio.wait_for(staying, 1) == "stay-0"


async def test_with_no_queue_a_busy_fleet_is_refused_at_once():
    fleet, queue = Fleet(0), RouterQueue(config(size=0))
    with pytest.raises(QueueRefusal) as refused:
        await queue.route("m", "normal", fleet.attempt("r-0"))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.retry_after_secs == 1


async def test_models_queue_apart():
    fleet_a, fleet_b, queue = Fleet(0), Fleet(1), RouterQueue(config())
    waiting = asyncio.create_task(queue.route("a", "normal", fleet_a.attempt("a-0")))
    await settle()
    assert await queue.route("b", "normal", fleet_b.attempt("b-0")) == "b-0"  # not behind model a's queue
    fleet_a.release(queue)
    assert await waiting == "a-0"


@pytest.mark.parametrize(
    ("text", "message"),
    [("high=1,normal=1", "no share for low"), ("high=0,normal=1,low=1", "above 0"), ("top=1", "class one of")],
)
def test_shares_are_checked(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        parse_shares(text)


def test_las_serves_the_session_served_least_lately_first_and_service_fades():
    from kvmesh.router.request_queue import ATTAINED_HALF_LIFE_S, Waiting, WaitingRequests

    queue = WaitingRequests(config(policy="las"))
    queue.served("agent", 4000, now=0.0)
    early = Waiting(1, "normal", 0, 0.0, session="agent", prompt_tokens=500)
    late = Waiting(2, "normal", 0, 0.5, session="chat", prompt_tokens=500)
    queue.add(early)
    queue.add(late)
    assert queue.next() is late  # the agent came first, but has been served 4,000 tokens already
    assert queue.attained("agent", ATTAINED_HALF_LIFE_S) == pytest.approx(2000)  # half a minute later: half
    queue.remove(late)
    queue.charge(late, now=1.0)
    assert queue.attained("chat", 1.0) == 500 and queue.next() is early
