"""The JetStream state kvmesh keeps (the KV event stream, the discovery bucket, the snapshot store, the
lease buckets), created replicated: it must outlive the loss of a NATS server (docs/decisions/0033).

Every stream, KV bucket and object store kvmesh creates goes through :func:`ensure_stream`,
:func:`ensure_key_value` or :func:`ensure_object_store`, which give it :func:`wanted_replicas`
replicas: ``--jetstream-replicas`` / ``$KVMESH_JETSTREAM_REPLICAS`` where set, else 3 on a NATS
cluster of three or more servers and 1 otherwise. One found with fewer replicas than wanted is
raised to them (JetStream moves a stream to more peers while it serves); where NATS refuses, the
service stops with :class:`ReplicationError`, whose message says how to fix it. A refusal for want
of peers that the cluster has servers for is asked again while JetStream places them
(:class:`PlacementPending`). :func:`latest_entry` reads a KV key as its stream's leader has it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig, StreamConfig, StreamInfo
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue
from nats.js.object_store import ObjectStore

from kvmesh.common.wire import names

log = structlog.get_logger(__name__)
T = TypeVar("T")

REPLICAS_ENV = "KVMESH_JETSTREAM_REPLICAS"
# JetStream's own advice: 3 replicas survive one server lost; 5 would survive two, at twice the writes.
CLUSTER_REPLICAS = 3
MAX_REPLICAS = 5  # JetStream's limit


class ReplicationError(RuntimeError):
    """A stream kvmesh uses has fewer replicas than wanted and could not be raised to them."""


class PlacementPending(ReplicationError):
    """JetStream found no peers to place the wanted replicas on although the cluster has the servers
    for them: one has joined the cluster but not yet JetStream's meta group (seconds after a cluster
    starts; an indexer died so in a CI drill). Asked again until ``JETSTREAM_WAIT_S``."""


# JetStream's error code for "no suitable peers for placement".
NO_SUITABLE_PEERS = 10005


def parse_replicas(raw: str | int | None) -> int | None:
    """A replica count from a flag or the environment; None: decide from the cluster's size."""
    if raw is None or raw == "" or raw == "auto":
        return None
    try:
        replicas = int(raw)
    except ValueError:
        raise ValueError(f"JetStream replicas must be a whole number from 1 to {MAX_REPLICAS}, not {raw!r}") from None
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"JetStream replicas must be from 1 to {MAX_REPLICAS}, not {replicas}")
    return replicas


def configure_replicas(requested: int | None) -> None:
    """Apply ``--jetstream-replicas`` to this process and the services it starts (through the
    environment, which they inherit); SystemExit with the reason where it is out of range."""
    if requested is None:
        return
    try:
        parse_replicas(requested)
    except ValueError as exc:
        raise SystemExit(f"--jetstream-replicas: {exc}") from None
    os.environ[REPLICAS_ENV] = str(requested)


def cluster_size(nc: NatsClient) -> int:
    """How many servers the connected server says its cluster has (1 for a lone server): the client
    URLs it gossips, one per server. nats-py keeps the server's INFO without a public accessor."""
    info: dict[str, Any] = getattr(nc, "_server_info", None) or {}
    if not info.get("cluster"):
        return 1
    return max(1, len(set(info.get("connect_urls") or [])))


def wanted_replicas(nc: NatsClient) -> int:
    """``$KVMESH_JETSTREAM_REPLICAS`` (which ``--jetstream-replicas`` sets), else 3 on a cluster of
    three or more servers, else 1. Never more than the cluster has servers to hold them."""
    try:
        requested = parse_replicas(os.environ.get(REPLICAS_ENV))
    except ValueError as exc:
        raise ReplicationError(f"{REPLICAS_ENV}: {exc}") from None
    if requested is not None:
        return requested
    return CLUSTER_REPLICAS if cluster_size(nc) >= CLUSTER_REPLICAS else 1


def _connection(js: JetStreamContext) -> NatsClient:
    return js._nc  # nats-py keeps the connection it was made from; it has no public accessor


# How long making or opening kvmesh's state waits for JetStream to answer. A cluster that has just
# started, or lost the server that led, answers nothing until its servers elect a leader (seconds);
# a service started with its NATS cluster must wait that out, not fail.
JETSTREAM_WAIT_S = 60.0
_NOT_YET = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,  # a publish to a stream that has no leader yet
)


async def when_jetstream_answers(operation: Callable[[], Awaitable[T]], what: str, *, made: bool = False) -> T:
    """``operation()``, tried again while JetStream does not answer (up to ``JETSTREAM_WAIT_S``).

    ``made``: the stream the operation reads was just made or found by this process, so "stream not
    found" is not yet too: a cluster's servers learn of a new stream from their meta leader, and one
    that has not yet answers so (seen in CI, an indexer reading the discovery bucket as it started)."""
    deadline = time.monotonic() + JETSTREAM_WAIT_S
    waited = False
    not_yet = (*_NOT_YET, PlacementPending, *((nats.js.errors.NotFoundError,) if made else ()))
    while True:
        try:
            result = await operation()
        except not_yet as exc:
            if time.monotonic() > deadline:
                if isinstance(exc, PlacementPending):
                    raise ReplicationError(f"{exc} (asked for {JETSTREAM_WAIT_S:g} s)") from exc
                raise ReplicationError(
                    f"JetStream did not answer within {JETSTREAM_WAIT_S:g} s ({what}: {type(exc).__name__}); "
                    "is a majority of the NATS cluster's servers up?"
                ) from exc
            if not waited:
                log.warning("JetStream does not answer yet (a cluster electing a leader?); waiting", what=what)
                waited = True
            await asyncio.sleep(0.5)
            continue
        if waited:
            log.info("JetStream answers", what=what)
        return result


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> StreamInfo:
    """The stream ``config.name``: created with the wanted replicas when missing (a concurrent creator
    is fine), raised to them when it has fewer; other settings of an existing stream are kept. Waits
    for JetStream to answer (see ``JETSTREAM_WAIT_S``)."""
    return await when_jetstream_answers(lambda: _ensure_stream(js, config), f"stream {config.name}")


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> StreamInfo:
    replicas = wanted_replicas(_connection(js))
    try:
        info = await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        try:
            return await js.add_stream(config, num_replicas=replicas)
        except nats.js.errors.APIError as exc:
            info = await _made_concurrently(js, config.name, replicas, exc)
    return await raise_replicas(js, info, replicas)


async def _made_concurrently(js: JetStreamContext, name: str, replicas: int, exc: Exception) -> StreamInfo:
    """After a refused create: the stream another process made meanwhile, or :class:`ReplicationError`
    (NATS cannot hold ``replicas`` replicas: a lone server, too few servers up)."""
    try:
        return await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        raise _refused(js, _refusal(name, 0, replicas, exc), replicas, exc) from exc


async def raise_replicas(js: JetStreamContext, info: StreamInfo, replicas: int) -> StreamInfo:
    """Raise an existing stream to ``replicas``; :class:`ReplicationError` where NATS refuses."""
    have = info.config.num_replicas or 1
    if have >= replicas:
        return info
    name = info.config.name or ""
    log.warning("raising a stream's replicas", stream=name, replicas=have, wanted=replicas)
    config = info.config.evolve(num_replicas=replicas)
    try:
        return await js.update_stream(config)
    except _NOT_YET:
        raise  # no answer is no refusal: asked again
    except nats.js.errors.APIError as exc:
        raise _refused(js, _refusal(name, have, replicas, exc), replicas, exc) from exc


def _refused(js: JetStreamContext, message: str, replicas: int, exc: Exception) -> ReplicationError:
    """The error for a refused placement: :class:`PlacementPending` (asked again) where NATS found no
    peers but its cluster has the servers to hold ``replicas``, else :class:`ReplicationError`."""
    no_peers = isinstance(exc, nats.js.errors.APIError) and exc.err_code == NO_SUITABLE_PEERS
    if no_peers and cluster_size(_connection(js)) >= replicas:
        return PlacementPending(message)
    return ReplicationError(message)


def _refusal(name: str, have: int, replicas: int, exc: Exception) -> str:
    held = f"has {have} replica(s)" if have else "cannot be created"
    return (
        f"JetStream stream {name} {held}, kvmesh wants {replicas}, and NATS refused ({exc}). Either give NATS "
        f"{replicas} servers with JetStream and raise it (`nats stream edit {name} --replicas {replicas}`), "
        f"or ask for fewer with --jetstream-replicas (or {REPLICAS_ENV})"
    )


async def ensure_key_value(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """The KV bucket ``config.bucket``, made as :func:`ensure_stream` makes a stream."""
    return await when_jetstream_answers(lambda: _ensure_key_value(js, config), f"bucket {config.bucket}")


@dataclass(frozen=True)
class LatestEntry:
    """A KV key's last message as its stream's leader has it: ``revision`` its stream sequence,
    ``value`` None where it marks the key deleted or purged, ``written_at`` server time (s since the
    epoch; None where the server gave none)."""

    revision: int
    value: bytes | None
    written_at: float | None


async def latest_entry(js: JetStreamContext, bucket: str, key: str) -> LatestEntry | None:
    """The last message of ``key`` in ``bucket``, read from the stream's leader; None where the key
    was never written or has aged out. Why not ``KeyValue.get``: nats-py reads keys directly, which
    any replica may answer, and one that lags (just restarted) answered with a deleted key's old
    value (seen on a cluster)."""
    try:
        message = await js.get_last_msg(names.kv_stream(bucket), f"$KV.{bucket}.{key}")
    except nats.js.errors.NotFoundError:
        return None
    gone = (message.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE)
    written = message.time
    if written is not None and written.tzinfo is None:
        written = written.replace(tzinfo=UTC)
    return LatestEntry(
        message.seq or 0, None if gone else (message.data or b""), None if written is None else written.timestamp()
    )


async def _ensure_key_value(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    return await _ensure_bucket(
        js,
        names.kv_stream(config.bucket),
        lambda: js.key_value(config.bucket),
        lambda replicas: js.create_key_value(config, replicas=replicas),
    )


async def ensure_object_store(js: JetStreamContext, config: ObjectStoreConfig) -> ObjectStore:
    """The object store ``config.bucket``, made as :func:`ensure_stream` makes a stream."""
    return await when_jetstream_answers(lambda: _ensure_object_store(js, config), f"object store {config.bucket}")


async def _ensure_object_store(js: JetStreamContext, config: ObjectStoreConfig) -> ObjectStore:
    assert config.bucket
    bucket = config.bucket
    return await _ensure_bucket(
        js,
        names.object_stream(bucket),
        lambda: js.object_store(bucket),
        lambda replicas: js.create_object_store(bucket, config=config.evolve(replicas=replicas)),
    )


async def _ensure_bucket(
    js: JetStreamContext,
    stream: str,
    open_bucket: Callable[[], Awaitable[T]],
    create_bucket: Callable[[int], Awaitable[T]],
) -> T:
    """A KV bucket or object store (held by ``stream``): opened, or created with the wanted replicas
    (a concurrent creator is fine); an existing one is raised to them."""
    replicas = wanted_replicas(_connection(js))
    try:
        bucket = await open_bucket()
    except nats.js.errors.BucketNotFoundError:
        try:
            return await create_bucket(replicas)
        except nats.js.errors.APIError as exc:
            await _made_concurrently(js, stream, replicas, exc)
            bucket = await open_bucket()
    await raise_replicas(js, await js.stream_info(stream), replicas)
    return bucket


@dataclass
class PeerState:
    """One replica of a stream as its leader sees it."""

    name: str
    current: bool
    offline: bool
    lag: int  # operations behind the leader
    active_s: float  # seconds since the leader last heard from it


@dataclass
class StreamState:
    """What ``kvmesh inspect jetstream`` and the metrics show of one stream."""

    stream: str
    replicas: int
    leader: str | None
    messages: int
    last_sequence: int
    peers: list[PeerState] = field(default_factory=list)

    @property
    def current_replicas(self) -> int:
        """Replicas that hold the stream now: the leader and every current follower."""
        return (1 if self.leader or self.replicas == 1 else 0) + sum(1 for p in self.peers if p.current)


def stream_state(info: StreamInfo) -> StreamState:
    cluster = info.cluster
    peers = [
        PeerState(
            name=p.name,
            current=bool(p.current),
            offline=bool(p.offline),
            lag=int(p.lag or 0),
            active_s=float(p.active or 0) / 1e9,  # JetStream reports nanoseconds
        )
        for p in (cluster.replicas or [] if cluster else [])
    ]
    return StreamState(
        stream=info.config.name or "",
        replicas=info.config.num_replicas or 1,
        leader=cluster.leader if cluster else None,
        messages=info.state.messages,
        last_sequence=info.state.last_seq,
        peers=peers,
    )


async def kvmesh_streams(js: JetStreamContext) -> list[StreamState]:
    """The state of every stream kvmesh keeps that exists now (streams of other applications on the
    same NATS are left out)."""
    wanted = names.jetstream_streams()
    states = []
    for name in wanted:
        try:
            states.append(stream_state(await js.stream_info(name)))
        except nats.js.errors.NotFoundError:
            continue
    return states
