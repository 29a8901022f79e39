"""Purging the events a snapshot covers (step 3 of ``snapshot.py``): only those that every durable
consumer of the namespace has acknowledged, and none while the server cannot list every one of
them."""

from __future__ import annotations

import asyncio
import json

import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig, ConsumerInfo

from kvmesh.common.wire import names

log = structlog.get_logger(__name__)
JS_API = "$JS.API"  # the JetStream API's subject prefix (no domain: kvmesh's servers run none)
LISTED_POLL_S = 0.1


class IncompleteConsumerList(RuntimeError):
    """The server could not list every consumer of the stream: their ack floors are unknown."""


async def durables_following(nc: NatsClient, namespace: str) -> list[ConsumerInfo]:
    """Every durable consumer of the KV events stream that reads ``namespace``'s events, from the
    JetStream API's consumer list (paged). Raises :class:`IncompleteConsumerList` where the server
    names consumers it could not read: a clustered stream lists as "missing" those whose leader it
    cannot reach, and nats-py's ``consumers_info`` drops that list. Behind a partition such a
    replica's ack floor is unknown; purging without it purged 621 messages one replica had not
    read, and it kept a worker that published nothing later stale (the partition drill, 2026-11-29)."""
    subject = names.kv_events_wildcard(namespace)
    found: list[ConsumerInfo] = []
    offset = 0
    while True:
        request = json.dumps({"offset": offset}).encode()
        reply = await nc.request(f"{JS_API}.CONSUMER.LIST.{names.KV_EVENTS_STREAM}", request, timeout=5)
        body = json.loads(reply.data)
        if body.get("error") or body.get("missing"):
            raise IncompleteConsumerList(f"error {body.get('error')}, missing {body.get('missing')}")
        page = body.get("consumers") or []
        for raw in page:
            info = ConsumerInfo.from_response(raw)
            if info.config.durable_name and _follows(info.config, subject):
                found.append(info)
        offset += len(page)
        if not page or offset >= body.get("total", 0):
            return found


async def purge_covered(nc: NatsClient, namespace: str, snapshot_sequence: int) -> int:
    """Purge ``namespace``'s events that every durable consumer following them acknowledged and the
    snapshot covers; returns the new first sequence kept of them (0 when nothing could be purged,
    also where the server could not list every consumer). Other namespaces' events stay, whatever
    their sequence."""
    floor = snapshot_sequence
    try:
        durables = await durables_following(nc, namespace)
    except IncompleteConsumerList as exc:
        log.warning("not purging: the server could not list every consumer of the events", error=str(exc))
        return 0
    for info in durables:
        floor = min(floor, info.ack_floor.stream_seq if info.ack_floor else 0)
    if floor <= 0:
        return 0
    subject = names.kv_events_wildcard(namespace)
    await nc.jetstream().purge_stream(names.KV_EVENTS_STREAM, seq=floor + 1, subject=subject)
    return floor + 1


def _follows(config: ConsumerConfig, subject: str) -> bool:
    """Whether a consumer reads ``subject``'s messages (one without a filter reads them all)."""
    if config.filter_subjects:
        return subject in config.filter_subjects
    return not config.filter_subject or config.filter_subject == subject


async def wait_listed(nc: NatsClient, namespace: str, durable: str, timeout_s: float) -> bool:
    """Whether ``durable`` is in a complete list of ``namespace``'s durables within ``timeout_s``.

    A purge pins its floor only at the durables the server lists. A durable just made can be left
    out of a list the server gives as complete until its assignment reaches the stream's leader
    (seen under CI load, 2026-12-04), so a replica that restored a snapshot holds the snapshot lock
    until its durable is listed: no other replica can purge past what it has not read meanwhile."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            if any(info.name == durable for info in await durables_following(nc, namespace)):
                return True
        except (IncompleteConsumerList, TimeoutError, nats.errors.Error):
            pass  # asked again until the deadline
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(LISTED_POLL_S)
