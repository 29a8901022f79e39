"""A lease refresh keeps the record a watcher holds; a changed record replaces it (discovery)."""

from __future__ import annotations

import dataclasses

import nats

from kvmesh.common.runtime.discovery import DiscoveryWatcher, InstanceRecord, Registration, instances_bucket
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer
from tests.support import wait_until_async


async def test_a_refreshed_record_is_the_one_held_and_a_changed_one_replaces_it():
    server = await EmbeddedNatsServer().start()
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        record = InstanceRecord("worker", 7, "127.0.0.1:1", namespace="refresh", lease_ttl=0.6, extra={"a": 1})
        registration = Registration(js, record)
        await registration.start()
        watcher = DiscoveryWatcher(js, "refresh", "worker")
        await watcher.start()
        await wait_until_async(lambda: len(watcher.instances()) == 1, what="the worker listed")
        held = watcher.instances()[0]
        bucket = await instances_bucket(js)
        first = (await bucket.get(record.key)).revision

        async def refreshed_twice() -> bool:
            return (await bucket.get(record.key)).revision >= first + 2

        await wait_until_async(refreshed_twice, what="two lease refreshes")
        # the watch delivers in order: once a later registration is listed, the refreshes were read
        other = Registration(js, dataclasses.replace(record, instance_id=8))
        await other.start()
        await wait_until_async(lambda: len(watcher.instances()) == 2, what="a second worker listed")
        assert watcher.get(7) is held and held == record
        await other.stop()

        changed = dataclasses.replace(record, extra={"a": 2})
        await registration.update(changed)
        await wait_until_async(lambda: watcher.get(7).extra == {"a": 2}, what="the changed record")
        assert watcher.get(7) is not held
        await registration.stop()
        await watcher.stop()
    finally:
        await nc.close()
        server.stop()
