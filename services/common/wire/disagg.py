"""What rides in ``disaggregated_params`` between router, prefill worker and decode worker.

The field is opaque bytes in the protos (DESIGN §5); this module is its one codec (a msgpack map with
a ``kind``), so router and workers agree on it without importing each other. One type per message:

- :class:`PrefillOrder` (router → prefill worker): prefill this prompt, hold its KV for ``room``;
- :class:`KvReady` (prefill worker → router, on its last output): the KV waits at ``host:port``;
- :class:`DecodeOrder` (router → decode worker): pull the prompt's KV from ``host:port`` in
  ``room`` (a rendezvous: on the bootstrap path the prefill may still be running), then decode;
- :class:`KvSource` (decode worker → frontend, on its first output): where the prompt's KV came from
  (the frontend passes it on to the router in its first-token report);
- :class:`PrefixPull` (router → worker, not split): pull these cached blocks of the prompt from
  another worker before computing the rest (docs/decisions/0070).
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, TypeVar

import msgpack

# Why a request was prefilled on its decode worker instead of remotely (the router's metric labels).
LOCAL_REASONS = (
    "below_threshold",  # the decode worker lacks fewer than --disagg-min-uncached-tokens of the prompt
    "no_prefill_capacity",  # every prefill worker is busy
    "prefill_failed",  # the prefill worker's request failed
    "transfer_failed",  # the KV transfer failed twice
    "decode_memory",  # the decode worker had no room to receive the KV
    "cached",  # the decode worker already held every transferable block
)


class DisaggParamsError(ValueError):
    """``disaggregated_params`` that cannot be read, or that are not the message expected."""


@dataclass(frozen=True)
class PrefillOrder:
    kind: ClassVar[str] = "prefill"
    room: int


@dataclass(frozen=True)
class KvReady:
    kind: ClassVar[str] = "kv_ready"
    room: int
    host: str
    port: int
    worker_id: int
    blocks: int  # transferable prompt blocks held for the room
    backend: str
    # an engine's own KV connector parameters (vLLM's kv_transfer_params, msgpack), opaque to the router
    engine_params: bytes = b""
    cached_tokens: int = 0  # prompt tokens the prefill found in its own cache


@dataclass(frozen=True)
class DecodeOrder:
    kind: ClassVar[str] = "decode"
    room: int
    host: str
    port: int
    worker_id: int
    # whether a failed transfer may fall back to a local prefill (not under --enforce-disagg)
    allow_local: bool = True
    engine_params: bytes = b""  # from KvReady: the engine's connector pulls the KV with them
    # from KvReady, when the prefill ran first (sync path); on the bootstrap path the pull brings it
    cached_tokens: int = 0

    @classmethod
    def from_ready(cls, ready: KvReady, allow_local: bool) -> DecodeOrder:
        return cls(
            ready.room, ready.host, ready.port, ready.worker_id, allow_local, ready.engine_params, ready.cached_tokens
        )


@dataclass(frozen=True)
class KvSource:
    kind: ClassVar[str] = "kv_source"
    source: str  # "remote" or "local"
    backend: str = ""
    bytes: int = 0
    blocks: int = 0  # blocks received
    reason: str = ""  # for "local": one of LOCAL_REASONS
    # for "remote": the prefill worker's cached prompt tokens, the usage the client is shown
    cached_tokens: int = 0

    @classmethod
    def local(cls, reason: str) -> KvSource:
        return cls("local", reason=reason)


# a worker whose engine moves cached blocks (and so can give and take a PrefixPull) says so in its record
MOVES_BLOCKS_KEY = "moves_blocks"


@dataclass(frozen=True)
class PrefixPull:
    kind: ClassVar[str] = "prefix_pull"
    worker_id: int  # the holder
    address: str  # its gRPC address (kvmesh.v1.Worker/OfferBlocks)
    sequence_hashes: list  # the blocks to pull, in prompt order, each after its parent

    def __post_init__(self) -> None:
        if not all(isinstance(h, int) and h >= 0 for h in self.sequence_hashes):
            raise DisaggParamsError("a prefix pull's sequence_hashes must be unsigned integers")


DisaggMessage = PrefillOrder | KvReady | DecodeOrder | KvSource | PrefixPull
_FIELD_TYPES = {"int": int, "str": str, "bool": bool, "bytes": bytes, "list": list}
_BY_KIND: dict[str, type[DisaggMessage]] = {
    t.kind: t for t in (PrefillOrder, KvReady, DecodeOrder, KvSource, PrefixPull)
}


def encode(message: DisaggMessage) -> bytes:
    return msgpack.packb({"kind": message.kind, **asdict(message)})


def decode(data: bytes) -> DisaggMessage:
    """Any of the five messages; :class:`DisaggParamsError` for anything else."""
    try:
        raw = msgpack.unpackb(data)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DisaggParamsError(f"disaggregated_params is not msgpack: {exc}") from None
    message_type = _BY_KIND.get(raw.get("kind")) if isinstance(raw, dict) else None
    if message_type is None:
        raise DisaggParamsError("disaggregated_params has no known kind")
    values = {}
    for f in fields(message_type):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if not isinstance(value, _FIELD_TYPES[f.type]):
            raise DisaggParamsError(f"disaggregated_params field {f.name!r} must be {f.type}, not {value!r}")
        values[f.name] = value
    try:
        return message_type(**values)
    except TypeError as exc:
        raise DisaggParamsError(f"disaggregated_params is malformed: {exc}") from None


M = TypeVar("M", PrefillOrder, KvReady, DecodeOrder, KvSource, PrefixPull)


def decode_as(data: bytes, expected: type[M]) -> M:
    """One message of the expected type; :class:`DisaggParamsError` for another or for garbage."""
    message = decode(data)
    if not isinstance(message, expected):
        raise DisaggParamsError(f"expected {expected.kind!r} params, got {message.kind!r}")
    return message


def default_kv_handoff(engine: str) -> str:
    """How an engine's prefills meet their decode workers unless it is told otherwise: the mock
    engine's decode half pulls from a rendezvous at once (``bootstrap``); an engine with its own KV
    connector (vLLM) hands out its KV's whereabouts only once the prefill has run (``sync``)."""
    return "bootstrap" if engine == "mock" else "sync"


def new_room() -> int:
    """A random 64-bit rendezvous id (SGLang's bootstrap room)."""
    return secrets.randbits(63)
