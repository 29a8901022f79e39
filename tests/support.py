"""Helpers shared by the tests: waiting on conditions (never bare sleeps) and free ports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from services.common.nats_server import free_port

__all__ = ["free_port", "wait_until", "wait_until_async"]


async def wait_until_async(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
