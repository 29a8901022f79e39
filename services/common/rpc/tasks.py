"""Background tasks ended cleanly: what every long-lived stream and service loop does when it stops."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

# How long a cancelled task may unwind before it is cancelled again. The tasks stopped here re-raise
# a cancellation at once; one still running after this long lost it (see cancel_and_wait).
RECANCEL_AFTER_S = 1.0


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel background tasks and wait until they have finished unwinding (None entries skipped).

    Guarantee: returns once every task is done, even one that swallowed its cancellation. Python
    3.11's ``asyncio.wait_for`` (used in nats-py's requests and in ours) returns the result of an
    operation that completes in the same moment as the cancellation arrives and drops the
    cancellation (CPython gh-86296, fixed in 3.12): a loop caught there runs on, and waiting for it
    would hang its service's shutdown. Such a task is cancelled again every ``RECANCEL_AFTER_S``.
    As before, a cancellation of the caller while it waits reaches the task it waits for, and the
    caller goes on to the next (what its clean-up after this call relies on)."""
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    for task in pending:
        stop_recancelling = _cancel_until_done(task)
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            stop_recancelling()


def _cancel_until_done(task: asyncio.Task) -> Callable[[], None]:
    """Cancel ``task`` again every ``RECANCEL_AFTER_S`` while it runs; returns what stops that."""
    loop = asyncio.get_running_loop()
    handle: asyncio.TimerHandle | None = None

    def cancel_again() -> None:
        nonlocal handle
        if not task.done():
            log.debug("a cancelled task still runs; cancelling it again", task=task.get_name())
            task.cancel()
            handle = loop.call_later(RECANCEL_AFTER_S, cancel_again)

    handle = loop.call_later(RECANCEL_AFTER_S, cancel_again)
    return lambda: handle.cancel() if handle is not None else None
