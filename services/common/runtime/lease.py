"""A lease: at most one holder at a time of a key in a replicated KV bucket (for the planner: one
planner acts at a time, docs/decisions/0033).

The key lives in a bucket whose max age is the lease period, so JetStream deletes it one period after
its holder last wrote it. The holder rewrites it every quarter period, each time only if it is still
the last writer (a compare-and-set on the key's revision); a contender creates it only where it is
absent. A holder counts itself the holder until one period, less a safety margin, after it *sent* its
last successful write: the server wrote it no earlier, so the key outlives that belief and nobody else
can create it while the holder still acts. A holder cut off from NATS stops acting when its period
runs out, before anyone else can start.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.runtime.jetstream_state import ensure_key_value, when_jetstream_answers
from kvmesh.common.wire import names

log = structlog.get_logger(__name__)

# Part of the period a holder gives up early: JetStream's age-out runs on a timer, and clocks drift.
SAFETY_MARGIN = 0.2
REQUEST_TIMEOUT_S = 2.0


class Lease:
    """Contends for ``key`` in ``bucket`` as ``owner`` from :meth:`start` until :meth:`stop`.

    Guarantees: :meth:`held` is True for at most one owner at any moment (clocks advancing at the same
    rate, within the safety margin); a holder that stops hands the key over at once; a holder that
    dies (kill -9) is replaced within about one and a third periods of its last write."""

    def __init__(self, js: JetStreamContext, bucket: str, key: str, owner: str, period_s: float) -> None:
        self._js = js
        self.bucket = bucket
        self.key = key
        self.owner = owner
        self.period_s = period_s
        self._kv: KeyValue | None = None
        self._revision = 0
        self._valid_until = 0.0  # monotonic
        self._task: asyncio.Task[None] | None = None

    def held(self) -> bool:
        return time.monotonic() < self._valid_until

    async def start(self) -> None:
        self._kv = await ensure_key_value(self._js, KeyValueConfig(bucket=self.bucket, history=1, ttl=self.period_s))
        # The bucket's max age is the lease period, whoever made the bucket: believe it over our own.
        info = await when_jetstream_answers(
            lambda: self._js.stream_info(names.kv_stream(self.bucket)), "lease", made=True
        )
        if info.config.max_age and abs(info.config.max_age - self.period_s) > 1e-3:
            log.warning(
                "the lease bucket has another period; using it", bucket=self.bucket, period_s=info.config.max_age
            )
            self.period_s = info.config.max_age
        await self._contend()
        self._task = asyncio.create_task(self._contend_forever(), name=f"lease-{self.key}")

    async def _contend_forever(self) -> None:
        while True:
            await asyncio.sleep(self.period_s / 4)
            await self._contend()

    async def _contend(self) -> None:
        assert self._kv is not None
        was_held = self.held()
        sent_at = time.monotonic()
        try:
            if self._revision:
                write = self._kv.update(self.key, self.owner.encode(), last=self._revision)
            else:
                write = self._kv.create(self.key, self.owner.encode())
            self._revision = await asyncio.wait_for(write, REQUEST_TIMEOUT_S)
            self._valid_until = sent_at + self.period_s * (1 - SAFETY_MARGIN)
        except nats.js.errors.KeyWrongLastSequenceError:
            # Someone else holds it (or took it after ours aged out): we do not.
            self._revision = 0
            self._valid_until = 0.0
        except Exception as exc:  # NATS unreachable or slow: what we held runs out on its own
            log.debug("lease write failed", key=self.key, error=f"{type(exc).__name__}: {exc}")
        if self.held() != was_held:
            log.info("lease taken" if self.held() else "lease lost", key=self.key, owner=self.owner)

    async def stop(self) -> None:
        """Stop contending; a holder deletes the key so that another takes over at once."""
        if self._task is not None:
            await cancel_and_wait(self._task)
        held, self._valid_until = self.held(), 0.0
        if held and self._kv is not None and self._revision:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._kv.delete(self.key, last=self._revision), REQUEST_TIMEOUT_S)
            log.info("lease released", key=self.key, owner=self.owner)
