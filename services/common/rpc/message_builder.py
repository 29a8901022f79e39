"""A stream's next message, built in place while the one before it is being written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from kvmesh.common.rpc.batch_queue import BatchQueue

M = TypeVar("M")


class MessageBuilder(Generic[M]):
    """The next message of one stream's writer: :meth:`add` appends an item to its repeated field
    ``field`` and returns it, to be filled in place; :meth:`take` waits until the message holds an
    item (or :meth:`wake` was called) and returns it, leaving a new empty one for what comes next.

    Guarantees: every item added goes out in exactly one taken message, in the order added. One
    taker only. Why in place: protobuf's Python constructors copy a nested message field through
    a slow path, so wrapping a request in a command and the command in the stream's message copied
    its token ids twice over (a 1,250-token forward: 46 µs, against 15 µs built in place with one
    ``CopyFrom``; docs/decisions/0019).
    """

    __slots__ = ("_field", "_message", "_new", "_wakes", "_woken")

    def __init__(self, new: Callable[[], M], field: str) -> None:
        """``new``: makes an empty message; ``field``: the name of its repeated message field."""
        self._new = new
        self._field = field
        self._message = new()
        self._wakes: BatchQueue[None] = BatchQueue()  # one entry per message with something to send
        self._woken = False

    def add(self) -> Any:
        """A new item at the end of the next message, to be filled before the caller awaits."""
        item = getattr(self._message, self._field).add()
        self.wake()
        return item

    def wake(self) -> None:
        """Let :meth:`take` return the next message even if no item is added (a message that
        carries something else, as a query stream's reports)."""
        if not self._woken:
            self._woken = True
            self._wakes.add(None)

    async def take(self) -> M:
        await self._wakes.take()
        message, self._message, self._woken = self._message, self._new(), False
        return message
