"""What rides in ``disaggregated_params`` between router, prefill worker and decode worker.

The field is opaque bytes in the protos (DESIGN §5); this module is its one codec (msgpack maps), so
router and workers agree on it without importing each other. Four shapes, by ``kind``:

- ``prefill`` (router → prefill worker): prefill this prompt, hold its KV for room ``room``;
- ``prefilled`` (prefill worker → router): the KV is ready at ``host:port`` in ``room``;
- ``decode`` (router → decode worker): pull the prompt's KV from ``host:port`` in ``room`` (a
  rendezvous: on the bootstrap path the prefill may still be running), then decode;
- ``kv_source`` (decode worker → router, on its first output): where the prompt's KV came from.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, fields

import msgpack

PREFILL = "prefill"
PREFILLED = "prefilled"
DECODE = "decode"
KV_SOURCE = "kv_source"

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
    """``disaggregated_params`` that cannot be read."""


@dataclass
class DisaggParams:
    kind: str
    room: int = 0
    host: str = ""
    port: int = 0
    worker_id: int = 0
    # decode: whether a failed transfer may fall back to a local prefill (not under --enforce-disagg)
    allow_local: bool = True
    # prefilled: transferable blocks held; kv_source: blocks received
    blocks: int = 0
    # kv_source: "remote" or "local", the transfer backend, bytes received and the local reason
    source: str = ""
    backend: str = ""
    bytes: int = 0
    reason: str = ""

    def encode(self) -> bytes:
        defaults = DisaggParams(self.kind)
        return msgpack.packb({k: v for k, v in asdict(self).items() if k == "kind" or v != getattr(defaults, k)})

    @classmethod
    def decode(cls, data: bytes) -> DisaggParams:
        try:
            raw = msgpack.unpackb(data)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise DisaggParamsError(f"disaggregated_params is not msgpack: {exc}") from None
        if not isinstance(raw, dict) or raw.get("kind") not in (PREFILL, PREFILLED, DECODE, KV_SOURCE):
            raise DisaggParamsError("disaggregated_params has no known kind")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as exc:
            raise DisaggParamsError(f"disaggregated_params is malformed: {exc}") from None


def new_room() -> int:
    """A random 64-bit rendezvous id (SGLang's bootstrap room)."""
    return secrets.randbits(63)
