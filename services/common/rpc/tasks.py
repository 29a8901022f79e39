"""Background tasks ended cleanly: what every long-lived stream and service loop does when it stops."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel background tasks and wait until they have finished unwinding (None entries skipped)."""
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
