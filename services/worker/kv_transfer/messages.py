"""The control messages of a KV pull, typed (each travels as one msgpack map in a length-prefixed
frame, see :mod:`~kvmesh.worker.kv_transfer.transport`).

A pull is one conversation: the decode worker sends a :class:`PullRequest`; the prefill worker
answers :class:`PullGranted` (then the bytes move) or :class:`PullRefused`; the decode worker closes
with :class:`PullDone` once it has checked what it received.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


class TransferError(Exception):
    """A KV pull failed. ``retryable``: trying again may work (timeout, lost connection), unlike a
    prefill that failed for good."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


_TYPES = {"int": int, "str": str, "bool": bool, "float": (int, float), "bytes": bytes, "list[int]": list}


def _from_frame(cls: type, frame: dict[str, Any], skip: tuple[str, ...] = ()) -> Any:
    """An instance of the message dataclass ``cls`` from a decoded frame, types checked."""
    values = {}
    for f in fields(cls):
        if f.name in skip or f.name not in frame:
            continue
        value = frame[f.name]
        if not isinstance(value, _TYPES[f.type]):
            raise TransferError(f"{cls.__name__}.{f.name} must be {f.type}, not {type(value).__name__}", False)
        values[f.name] = value
    try:
        return cls(**values)
    except TypeError as exc:
        raise TransferError(f"malformed {cls.__name__}: {exc}", retryable=False) from None


@dataclass(frozen=True)
class PullRequest:
    """Decode → prefill: blocks ``first_block`` … ``first_block + num_blocks - 1`` of ``room``."""

    room: int
    first_block: int
    num_blocks: int
    block_bytes: int
    backend: str  # the data plane the decode worker prefers
    wait_s: float  # how long the prefill worker may wait for the room to be ready

    def to_frame(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> PullRequest:
        return _from_frame(cls, frame)


@dataclass(frozen=True)
class PullGranted:
    """Prefill → decode: the blocks are in these ``slots``; over NIXL, read them from the agent."""

    backend: str
    slots: list[int]
    agent: str = ""
    metadata: bytes = b""
    address: int = 0
    # prompt tokens the prefill worker found in its own cache: the usage the client is shown
    cached_tokens: int = 0

    def to_frame(self) -> dict[str, Any]:
        return {"ok": True, **asdict(self)}


@dataclass(frozen=True)
class PullRefused:
    """Prefill → decode: no blocks, and why."""

    error: str
    retry: bool = True

    def to_frame(self) -> dict[str, Any]:
        return {"ok": False, **asdict(self)}


def answer_from_frame(frame: dict[str, Any]) -> PullGranted | PullRefused:
    if frame.get("ok") is True:
        return _from_frame(PullGranted, frame)
    return _from_frame(PullRefused, frame)


@dataclass(frozen=True)
class PullDone:
    """Decode → prefill: every block arrived and checked out; the held KV can go."""

    received: bool = True

    def to_frame(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> PullDone:
        return _from_frame(cls, frame)
