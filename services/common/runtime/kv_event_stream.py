"""The JetStream stream of KV events (DESIGN §3), created on first use by whoever needs it."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

from kvmesh.common.runtime.jetstream_state import ensure_stream
from kvmesh.common.wire import names

DEFAULT_MAX_AGE_S = 3600.0
DUPLICATE_WINDOW_S = 120.0


def kv_events_stream_config(max_age_s: float = DEFAULT_MAX_AGE_S) -> StreamConfig:
    return StreamConfig(
        name=names.KV_EVENTS_STREAM,
        # One stream for every namespace; consumers filter on their namespace's subjects.
        subjects=["kvmesh.*.kv.*"],
        storage=StorageType.FILE,
        max_age=max_age_s,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


async def ensure_kv_events_stream(js: JetStreamContext, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
    """Create the stream, replicated, if it is missing; an existing stream keeps its settings but is
    raised to the wanted replicas (:mod:`kvmesh.common.runtime.jetstream_state`)."""
    await ensure_stream(js, kv_events_stream_config(max_age_s))
