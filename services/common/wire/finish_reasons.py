"""Why a generation ended, in one vocabulary for engines, the wire and the OpenAI API.

Engines report a :class:`FinishReason`; the protos carry ``common_pb2.FinishReason``; clients see
the enum's value (``"length"``, ``"stop"``, ...), which is also OpenAI's ``finish_reason``.
"""

from __future__ import annotations

from enum import Enum

from kvmesh.common.proto.kvmesh.v1 import common_pb2


class FinishReason(Enum):
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


_TO_PROTO = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FROM_PROTO = {wire: reason for reason, wire in _TO_PROTO.items()}


def to_proto(reason: FinishReason) -> common_pb2.FinishReason:
    return _TO_PROTO[reason]


def from_proto(value: int) -> FinishReason | None:
    """The reason a message carries; None while the generation goes on (``UNSPECIFIED``)."""
    return _FROM_PROTO.get(value)


def finish_name(value: int, default: str | None = None) -> str | None:
    """The client-facing name of a wire finish reason (``default`` while unfinished)."""
    reason = _FROM_PROTO.get(value)
    return reason.value if reason is not None else default
