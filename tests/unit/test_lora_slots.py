"""The LoRA adapters a worker holds loaded (at most --max-loras), and the wire helpers around them."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.common.wire.lora import adapter_paths, must_load
from kvmesh.worker.lora_slots import AdapterSlots


def test_adapters_are_named_alone_or_with_their_directory():
    assert adapter_paths(" sql=/a/sql , chat ") == {"sql": "/a/sql", "chat": None}
    assert tuple(adapter_paths("sql=/a/sql,chat")) == ("sql", "chat")  # in the order given
    with pytest.raises(ValueError, match="bad LoRA adapter name"):
        adapter_paths("=/a")


def test_a_worker_must_load_only_what_it_advertises_as_not_loaded():
    assert not must_load({"lora_adapters": ["a", "b"]}, "b")  # no resident list: all loaded
    assert must_load({"lora_adapters": ["a", "b"], "lora_resident": ["a"]}, "b")
    assert not must_load({"lora_adapters": ["a", "b"], "lora_resident": ["a"]}, "a")


async def test_the_least_recently_used_adapter_is_evicted_for_a_load():
    slots = AdapterSlots(["a", "b", "c"], capacity=2)
    assert slots.limited and slots.loaded() == ["a", "b"]
    assert not await slots.use("a")  # loaded already: now the most recently used
    assert not slots.changed.is_set()
    assert await slots.use("c")  # evicts b, the least recently used
    assert slots.loaded() == ["a", "c"] and slots.changed.is_set() and slots.loads == 1


async def test_concurrent_requests_for_an_adapter_share_one_load():
    slots = AdapterSlots(["a", "b"], capacity=1, load_s=0.01)
    loaded = await asyncio.gather(*(slots.use("b") for _ in range(5)))
    assert loaded.count(True) == 1 and slots.loads == 1 and slots.loaded() == ["b"]


async def test_a_load_cancelled_midway_leaves_the_next_request_to_load_it():
    slots = AdapterSlots(["a", "b"], capacity=1, load_s=10)
    first = asyncio.create_task(slots.use("b"))
    await asyncio.sleep(0)  # the load has begun
    waiting = asyncio.create_task(slots.use("b"))
    await asyncio.sleep(0)
    first.cancel()
    slots.load_s = 0
    assert await waiting  # it loaded b itself
    assert slots.loaded() == ["b"]


def test_without_a_limit_every_adapter_stays_loaded():
    slots = AdapterSlots(["a", "b"], capacity=0)
    assert not slots.limited and slots.loaded() == ["a", "b"]
