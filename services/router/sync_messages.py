"""The wire type of router replica sync (DESIGN §5): one msgpack map per request event.

``kind`` is one of AddRequest (``add``), MarkPrefillCompleted (``prefill_done``), Free (``free``)
or a ``heartbeat``; every message names the ``router_id`` that sent it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

ADD, PREFILL_DONE, FREE, HEARTBEAT = "add", "prefill_done", "free", "heartbeat"


@dataclass(frozen=True)
class SyncMessage:
    kind: str
    router_id: str
    request_id: str = ""
    worker_id: int = 0
    dp_rank: int = 0
    block_size: int = 0
    block_hashes: tuple[int, ...] = field(default_factory=tuple)
    prompt_tokens: int = 0
    overlap_blocks: int = 0
    expected_output_tokens: int = 0
    session: str = ""  # an add's session (its affinity is shared too)

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "kind": self.kind,
                "router_id": self.router_id,
                "request_id": self.request_id,
                "worker_id": self.worker_id,
                "dp_rank": self.dp_rank,
                "block_size": self.block_size,
                "block_hashes": list(self.block_hashes),
                "prompt_tokens": self.prompt_tokens,
                "overlap_blocks": self.overlap_blocks,
                "expected_output_tokens": self.expected_output_tokens,
                "session": self.session,
            }
        )

    @classmethod
    def decode(cls, payload: bytes) -> SyncMessage:
        raw = msgpack.unpackb(payload)
        return cls(
            kind=str(raw["kind"]),
            router_id=str(raw["router_id"]),
            request_id=str(raw.get("request_id", "")),
            worker_id=int(raw.get("worker_id", 0)),
            dp_rank=int(raw.get("dp_rank", 0)),
            block_size=int(raw.get("block_size", 0)),
            block_hashes=tuple(int(h) for h in raw.get("block_hashes", ())),
            prompt_tokens=int(raw.get("prompt_tokens", 0)),
            overlap_blocks=int(raw.get("overlap_blocks", 0)),
            expected_output_tokens=int(raw.get("expected_output_tokens", 0)),
            session=str(raw.get("session", "")),
        )
