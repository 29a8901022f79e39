"""The planners' shared memory (``--state-store nats``): every step the acting planner takes, as one
message on ``kvmesh.<namespace>.planner.steps`` in the replicated JetStream stream
``KVMESH_PLANNER_STEPS``.

Why a stream and not each replica's SQLite file: a standby that takes the lease must decide as the
planner it replaces would have, so it needs that planner's history (predictor windows, model
corrections, utilisation cap, hysteresis), and a Kubernetes pod's disk dies with the pod. The stream
is replicated like the rest of kvmesh's state (three copies on a NATS cluster), so the history
survives the loss of a planner, of its node and of one NATS server (docs/decisions/0050).

Guarantees: :meth:`JetStreamSteps.record` returns once JetStream has stored the step (a step is
stored or not); :meth:`JetStreamSteps.recent` returns the namespace's last steps in the order they
were recorded; every namespace keeps its own last ``KEEP_STEPS`` steps, whatever others record.
"""

from __future__ import annotations

import contextlib
import json

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, StreamConfig

from kvmesh.common.runtime.jetstream_state import ensure_stream, when_jetstream_answers
from kvmesh.common.wire import names
from kvmesh.planner.decision import Decision
from kvmesh.planner.load import IntervalObservation
from kvmesh.planner.state import RESUME_STEPS, StoredStep

log = structlog.get_logger(__name__)

# Steps kept per namespace: four times what a resume replays, so a longer SLA window still fits.
KEEP_STEPS = 4 * RESUME_STEPS
FETCH_BATCH = 256


class JetStreamSteps:
    """One namespace's planner steps in JetStream. Use as ``async with JetStreamSteps(nc, ns) as state``
    (the same interface as :class:`kvmesh.planner.state.PlannerState`)."""

    def __init__(self, nc: NatsClient, namespace: str) -> None:
        self._js = nc.jetstream()
        self.namespace = namespace
        self.subject = names.planner_steps_subject(namespace)

    async def __aenter__(self) -> JetStreamSteps:
        await ensure_stream(
            self._js,
            StreamConfig(
                name=names.PLANNER_STEPS_STREAM,
                subjects=[names.planner_steps_subject("*")],
                max_msgs_per_subject=KEEP_STEPS,
                discard=DiscardPolicy.OLD,
            ),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def record(self, observation: IntervalObservation, decision: Decision) -> None:
        payload = json.dumps(StoredStep(observation, decision).to_dict()).encode()
        await when_jetstream_answers(
            lambda: self._js.publish(self.subject, payload, stream=names.PLANNER_STEPS_STREAM), "planner step"
        )

    async def count(self) -> int:
        info = await self._js.stream_info(names.PLANNER_STEPS_STREAM, subjects_filter=self.subject)
        return int((info.state.subjects or {}).get(self.subject, 0))

    async def last(self) -> StoredStep | None:
        """The latest step, or None where none is recorded."""
        try:
            message = await self._js.get_last_msg(names.PLANNER_STEPS_STREAM, self.subject)
        except nats.js.errors.NotFoundError:
            return None
        return StoredStep.from_dict(json.loads(message.data or b""))

    async def recent(self, limit: int) -> list[StoredStep]:
        """The last ``limit`` steps, oldest first (at most ``KEEP_STEPS``: the stream keeps no more)."""
        if limit > KEEP_STEPS:
            log.warning("the step stream keeps fewer steps than asked for", asked=limit, kept=KEEP_STEPS)
        count = await self.count()
        if count == 0:
            return []
        # An ephemeral consumer over the namespace's subject: the stream keeps at most KEEP_STEPS of
        # them, so reading all and keeping the tail is bounded.
        sub = await self._js.pull_subscribe(
            self.subject,
            stream=names.PLANNER_STEPS_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30),
        )
        steps: list[StoredStep] = []
        try:
            while True:
                try:
                    messages = await sub.fetch(FETCH_BATCH, timeout=2)
                except (TimeoutError, nats.errors.TimeoutError):
                    break
                steps.extend(StoredStep.from_dict(json.loads(m.data)) for m in messages)
                if messages and messages[-1].metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return steps[-limit:] if limit > 0 else []
